// The infergate dashboard: polls the gateway's cluster API and draws tables
// and charts by hand (no libraries, nothing fetched from elsewhere).
//
// Data flow: /v2/cluster/stats returns cumulative counters; each poll is kept
// for a few seconds and rates/percentiles are differences between the newest
// poll and the one about WINDOW_S earlier. Each poll also appends one point
// per model (and one for the whole cluster) to short histories for the charts.
//
// Tables keep one <tr> per worker/model for the page's life: an update only
// rewrites the cells whose text changed and moves rows when the order
// changes, so 50 workers and 200 models cost no DOM churn every second.
"use strict";
(() => {
  const STATS_MS = 1000;
  const CLUSTER_MS = 5000;
  const WINDOW_S = 5;
  const HISTORY_S = 300;
  const HISTORY_POINTS = Math.ceil((HISTORY_S * 1000) / STATS_MS) + 5;
  const COLORS = { a: "#2f6fde", b: "#d64545", c: "#1f9d55", d: "#d98e04" };

  const $ = (id) => document.getElementById(id);

  // ---- formatting ----------------------------------------------------------

  function num(v, digits) {
    if (v === null || v === undefined || !Number.isFinite(v)) return "–";
    if (digits !== undefined) return v.toFixed(digits);
    const a = Math.abs(v);
    return a >= 100 ? v.toFixed(0) : a >= 10 ? v.toFixed(1) : v.toFixed(2);
  }
  function ms(seconds) {
    return seconds === null || seconds === undefined ? "–" : num(seconds * 1000) + " ms";
  }
  function bytes(b) {
    if (!Number.isFinite(b)) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (b >= 1024 && i < units.length - 1) { b /= 1024; i += 1; }
    return (b >= 100 || i === 0 ? b.toFixed(0) : b.toFixed(1)) + " " + units[i];
  }
  const collator = new Intl.Collator(undefined, { numeric: true });
  function cmp(a, b) {
    if (a === b) return 0;
    if (a === null || a === undefined) return -1;
    if (b === null || b === undefined) return 1;
    // Strings in natural order: 10.0.0.2 before 10.0.0.10, model-2 before model-10.
    if (typeof a === "string" && typeof b === "string") return collator.compare(a, b);
    return a < b ? -1 : 1;
  }
  function counterDelta(now, before) {
    // A counter that went down was reset (its model was reloaded): count from zero.
    const d = (now || 0) - (before || 0);
    return d < 0 ? now || 0 : d;
  }

  // Percentile from a histogram's per-bucket counts (last bucket +Inf),
  // interpolating linearly inside the bucket the rank falls in.
  function quantile(counts, bounds, q) {
    let total = 0;
    for (const c of counts) total += c;
    if (total === 0) return null;
    const rank = q * total;
    let seen = 0;
    for (let i = 0; i < counts.length; i += 1) {
      const c = counts[i];
      if (c > 0 && seen + c >= rank) {
        const lower = i === 0 ? 0 : bounds[i - 1];
        const upper = i < bounds.length ? bounds[i] : bounds[bounds.length - 1];
        return lower + (upper - lower) * Math.min(1, Math.max(0, (rank - seen) / c));
      }
      seen += c;
    }
    return bounds[bounds.length - 1];
  }

  // ---- state -----------------------------------------------------------------

  const state = {
    paused: false,
    selected: null, // model name charted alone, or null for the whole cluster
    snapshots: [], // recent parsed /v2/cluster/stats polls, oldest first
    bounds: [],
    cluster: null, // last /v2/cluster
    live: new Map(), // model name -> window stats of the latest poll
    liveWorkers: new Map(), // address -> {inflight, sent_rate, failures, retries}
    total: null,
    history: new Map(), // model name (or "") -> {t: [], rps: [], eps: [], p50: [], p99: [], batch: [], queue: []}
  };

  function parseStats(json) {
    const models = new Map();
    for (const m of json.models) {
      let agg = models.get(m.model);
      if (!agg) {
        agg = { success: 0, failure: 0, executions: 0, rows: 0, queue: 0, lat: new Array(json.latency_bounds_s.length + 1).fill(0),
          tokens: null, ttft: null, itl: null };
        models.set(m.model, agg);
      }
      if (m.tokens !== undefined) { // a generative model: tokens, first-token and token-gap histograms
        agg.tokens = (agg.tokens || 0) + m.tokens;
        agg.ttft = addCounts(agg.ttft, m.ttft_counts);
        agg.itl = addCounts(agg.itl, m.itl_counts);
      }
      agg.success += m.success;
      agg.failure += m.failure;
      agg.executions += m.executions;
      agg.rows += m.batch_rows;
      agg.queue += m.queue_depth;
      m.latency_counts.forEach((c, i) => { agg.lat[i] += c; });
    }
    const workers = new Map(json.workers.map((w) => [w.address, w]));
    return { t: json.time, models, workers };
  }

  function addCounts(into, counts) {
    const out = into || [];
    (counts || []).forEach((c, i) => { out[i] = (out[i] || 0) + c; });
    return out;
  }

  function windowOf(cur, base, name) {
    const a = cur.models.get(name);
    const b = base ? base.models.get(name) : undefined;
    const dt = base ? cur.t - base.t : 0;
    if (!a) return null;
    const out = { rps: null, eps: null, p50: null, p99: null, batch: null, queue: a.queue, lat: null, ds: 0, df: 0, dx: 0, dr: 0 };
    if (!(dt > 0)) return out;
    out.ds = counterDelta(a.success, b && b.success);
    out.df = counterDelta(a.failure, b && b.failure);
    out.dx = counterDelta(a.executions, b && b.executions);
    out.dr = counterDelta(a.rows, b && b.rows);
    out.lat = a.lat.map((c, i) => counterDelta(c, b && b.lat[i]));
    out.rps = out.ds / dt;
    out.eps = out.df / dt;
    out.batch = out.dx > 0 ? out.dr / out.dx : null;
    out.p50 = quantile(out.lat, state.bounds, 0.5);
    out.p99 = quantile(out.lat, state.bounds, 0.99);
    if (a.tokens !== null) {
      out.tps = counterDelta(a.tokens, b && b.tokens) / dt;
      const ttft = a.ttft.map((c, i) => counterDelta(c, b && b.ttft && b.ttft[i]));
      const itl = a.itl.map((c, i) => counterDelta(c, b && b.itl && b.itl[i]));
      out.ttft50 = quantile(ttft, state.bounds, 0.5);
      out.itl50 = quantile(itl, state.gapBounds, 0.5);
    }
    return out;
  }

  function onStats(json) {
    state.bounds = json.latency_bounds_s;
    state.gapBounds = json.token_gap_bounds_s || [];
    const cur = parseStats(json);
    const snaps = state.snapshots;
    snaps.push(cur);
    while (snaps.length > 2 && cur.t - snaps[1].t >= WINDOW_S) snaps.shift();
    const base = snaps.length > 1 ? snaps[0] : null;
    const dt = base ? cur.t - base.t : 0;

    const total = { rps: null, eps: null, p50: null, p99: null, batch: null, queue: 0 };
    const lat = new Array(state.bounds.length + 1).fill(0);
    let ds = 0, df = 0, dx = 0, dr = 0;
    state.live = new Map();
    for (const name of cur.models.keys()) {
      const w = windowOf(cur, base, name);
      state.live.set(name, w);
      total.queue += w.queue;
      if (w.lat) {
        ds += w.ds; df += w.df; dx += w.dx; dr += w.dr;
        w.lat.forEach((c, i) => { lat[i] += c; });
      }
    }
    if (dt > 0) {
      total.rps = ds / dt;
      total.eps = df / dt;
      total.batch = dx > 0 ? dr / dx : null;
      total.p50 = quantile(lat, state.bounds, 0.5);
      total.p99 = quantile(lat, state.bounds, 0.99);
    }
    state.total = total;

    state.liveWorkers = new Map();
    for (const [address, w] of cur.workers) {
      const before = base ? base.workers.get(address) : undefined;
      state.liveWorkers.set(address, {
        inflight: w.inflight,
        failures: w.failures,
        retries: w.retries,
        sentRate: dt > 0 ? counterDelta(w.sent, before && before.sent) / dt : null,
      });
    }

    record("", cur.t, total);
    for (const [name, w] of state.live) record(name, cur.t, w);
    for (const name of state.history.keys()) {
      if (name !== "" && !cur.models.has(name)) state.history.delete(name);
    }
  }

  function record(name, t, w) {
    let h = state.history.get(name);
    if (!h) {
      h = { t: [], rps: [], eps: [], p50: [], p99: [], batch: [], queue: [] };
      state.history.set(name, h);
    }
    h.t.push(t);
    h.rps.push(w.rps);
    h.eps.push(w.eps);
    h.p50.push(w.p50 === null ? null : w.p50 * 1000);
    h.p99.push(w.p99 === null ? null : w.p99 * 1000);
    h.batch.push(w.batch);
    h.queue.push(w.queue);
    if (h.t.length > HISTORY_POINTS) {
      for (const k of Object.keys(h)) h[k].shift();
    }
  }

  // ---- tables ------------------------------------------------------------------

  class Table {
    // columns: [{label, text(row), sort(row), cls?(row), title?(row), bar?(row) -> 0..1, num?, badge?}]
    constructor(id, columns, { sortIndex = 0, countId, onClick, rowClass } = {}) {
      this.el = $(id);
      this.body = this.el.tBodies[0];
      this.columns = columns;
      this.sortIndex = sortIndex;
      this.sortDir = 1;
      this.filter = "";
      this.data = [];
      this.rows = new Map();
      this.countEl = countId ? $(countId) : null;
      this.rowClass = rowClass;
      const tr = document.createElement("tr");
      this.heads = columns.map((c, i) => {
        const th = document.createElement("th");
        th.textContent = c.label;
        if (c.num) th.classList.add("num");
        th.addEventListener("click", () => {
          if (this.sortIndex === i) this.sortDir = -this.sortDir;
          else { this.sortIndex = i; this.sortDir = c.num ? -1 : 1; }
          this.render();
        });
        tr.appendChild(th);
        return th;
      });
      this.el.tHead.appendChild(tr);
      if (onClick) {
        this.body.addEventListener("click", (ev) => {
          const row = ev.target.closest("tr");
          if (row && row.dataset.key !== undefined) onClick(row.dataset.key);
        });
      }
    }

    setFilter(text) {
      this.filter = text.trim().toLowerCase();
      this.render();
    }

    update(data) {
      this.data = data;
      this.render();
    }

    makeRow(key) {
      const tr = document.createElement("tr");
      tr.dataset.key = key;
      const cells = this.columns.map((c) => {
        const td = document.createElement("td");
        if (c.num) td.className = "num";
        if (c.bar) {
          const bar = document.createElement("div");
          bar.className = "bar";
          bar.appendChild(document.createElement("i"));
          bar.appendChild(document.createElement("span"));
          td.appendChild(bar);
        } else if (c.badge) {
          const badge = document.createElement("span");
          badge.className = "badge";
          td.appendChild(badge);
        }
        tr.appendChild(td);
        return td;
      });
      const n = this.columns.length;
      return { tr, cells, text: new Array(n).fill(null), cls: new Array(n).fill(null), title: new Array(n).fill(null), bar: new Array(n).fill(null), rowCls: null };
    }

    render() {
      const col = this.columns[this.sortIndex];
      const dir = this.sortDir;
      const sorted = this.data.slice().sort((a, b) => dir * cmp(col.sort(a), col.sort(b)) || cmp(a.key, b.key));
      const seen = new Set();
      const order = [];
      let visible = 0;
      for (const row of sorted) {
        seen.add(row.key);
        let r = this.rows.get(row.key);
        if (!r) {
          r = this.makeRow(row.key);
          this.rows.set(row.key, r);
        }
        this.columns.forEach((c, i) => {
          const td = r.cells[i];
          const text = c.text(row);
          if (r.text[i] !== text) {
            (c.bar ? td.firstChild.lastChild : c.badge ? td.firstChild : td).textContent = text;
            r.text[i] = text;
          }
          if (c.cls) {
            const cls = (c.num ? "num " : "") + c.cls(row);
            if (r.cls[i] !== cls) { td.className = cls; r.cls[i] = cls; }
          }
          if (c.title) {
            const title = c.title(row);
            if (r.title[i] !== title) { td.title = title; r.title[i] = title; }
          }
          if (c.bar) {
            const f = c.bar(row);
            const pct = f === null ? 0 : Math.round(Math.min(1, Math.max(0, f)) * 1000) / 10;
            if (r.bar[i] !== pct) {
              td.firstChild.firstChild.style.width = pct + "%";
              td.firstChild.classList.toggle("high", pct >= 90);
              r.bar[i] = pct;
            }
          }
        });
        if (this.rowClass) {
          const rc = this.rowClass(row);
          if (r.rowCls !== rc) { r.tr.className = rc; r.rowCls = rc; }
        }
        const hide = this.filter !== "" && !row.search.includes(this.filter);
        if (r.tr.hidden !== hide) r.tr.hidden = hide;
        if (!hide) visible += 1;
        order.push(r.tr);
      }
      for (const [key, r] of this.rows) {
        if (!seen.has(key)) { r.tr.remove(); this.rows.delete(key); }
      }
      const kids = this.body.children;
      let same = kids.length === order.length;
      for (let i = 0; same && i < order.length; i += 1) same = kids[i] === order[i];
      if (!same) {
        const frag = document.createDocumentFragment();
        for (const tr of order) frag.appendChild(tr);
        this.body.appendChild(frag);
      }
      this.heads.forEach((th, i) => {
        th.classList.toggle("sorted-asc", i === this.sortIndex && dir > 0);
        th.classList.toggle("sorted-desc", i === this.sortIndex && dir < 0);
      });
      if (this.countEl) {
        const text = visible === sorted.length ? `(${sorted.length})` : `(${visible} of ${sorted.length})`;
        if (this.countEl.textContent !== text) this.countEl.textContent = text;
      }
    }
  }

  function deviceSummary(devices) {
    const gpus = devices.filter((d) => d.kind === "gpu");
    const list = gpus.length ? gpus : devices.filter((d) => d.kind === "cpu");
    if (!list.length) return null;
    let total = 0, used = 0, util = null;
    for (const d of list) {
      total += d.memory_total_bytes || 0;
      used += d.memory_used_bytes || 0;
      if (Number.isFinite(d.utilization)) util = Math.max(util === null ? 0 : util, d.utilization);
    }
    const what = gpus.length ? (gpus.length > 1 ? `${gpus.length}× GPU` : "GPU") : "host";
    const detail = devices.map((d) =>
      `${d.kind === "gpu" ? d.name + " " + (d.uuid || "") : "host"}: ${bytes(d.memory_used_bytes)} / ${bytes(d.memory_total_bytes)}` +
      (Number.isFinite(d.utilization) ? `, ${Math.round(d.utilization * 100)}% busy` : "")).join("\n");
    return { what, total, used, util, detail };
  }

  const workersTable = new Table("workers", [
    { label: "Address", text: (w) => w.address, sort: (w) => w.address },
    { label: "State", badge: true, text: (w) => w.state, sort: (w) => w.state, cls: (w) => "state-" + w.state, title: (w) => w.why || "" },
    { label: "Kind", text: (w) => w.kind, sort: (w) => w.kind },
    { label: "Models", num: true, text: (w) => String(w.models.length), sort: (w) => w.models.length, title: (w) => w.models.join(", ") },
    { label: "In flight", num: true, text: (w) => String(w.inflight), sort: (w) => w.inflight },
    { label: "Batches/s", num: true, text: (w) => num(w.sentRate), sort: (w) => w.sentRate },
    { label: "Failures", num: true, text: (w) => String(w.failures), sort: (w) => w.failures },
    { label: "Retries", num: true, text: (w) => String(w.retries), sort: (w) => w.retries },
    {
      label: "Device memory", bar: (w) => (w.dev && w.dev.total ? w.dev.used / w.dev.total : null),
      text: (w) => (w.dev ? `${w.dev.what} ${bytes(w.dev.used)} / ${bytes(w.dev.total)}` : "unknown"),
      sort: (w) => (w.dev && w.dev.total ? w.dev.used / w.dev.total : null), title: (w) => (w.dev ? w.dev.detail : ""),
    },
    { label: "Util", num: true, text: (w) => (w.dev && w.dev.util !== null ? Math.round(w.dev.util * 100) + "%" : "–"), sort: (w) => (w.dev ? w.dev.util : null) },
  ], { countId: "workers-count" });

  // Generation models' sequences and KV cache, one row per (worker, model); "gateway" is the gateway's own.
  const generationTable = new Table("generation", [
    { label: "Worker", text: (g) => g.worker, sort: (g) => g.worker },
    { label: "Model", text: (g) => g.model, sort: (g) => g.model },
    { label: "Running", num: true, text: (g) => String(g.running), sort: (g) => g.running },
    { label: "Waiting", num: true, text: (g) => String(g.waiting), sort: (g) => g.waiting },
    {
      label: "KV cache used / reserved", bar: (g) => (g.cache_reserved_bytes ? g.cache_bytes / g.cache_reserved_bytes : null),
      text: (g) => `${bytes(g.cache_bytes)} / ${bytes(g.cache_reserved_bytes)}`,
      sort: (g) => g.cache_bytes,
    },
  ], { countId: "generation-count" });

  const modelsTable = new Table("models", [
    { label: "Model", text: (m) => m.name, sort: (m) => m.name },
    { label: "State", badge: true, text: (m) => m.state, sort: (m) => m.state, cls: (m) => "state-" + m.state },
    { label: "Versions", text: (m) => m.versions.join(", "), sort: (m) => m.versions.join(",") },
    { label: "Replicas", num: true, text: (m) => String(m.replicas.length), sort: (m) => m.replicas.length, title: (m) => m.replicas.join("\n") },
    { label: "Max batch", num: true, text: (m) => String(m.max_batch_size), sort: (m) => m.max_batch_size },
    { label: "Req/s", num: true, text: (m) => num(m.live.rps), sort: (m) => m.live.rps },
    { label: "Err/s", num: true, text: (m) => num(m.live.eps), sort: (m) => m.live.eps },
    { label: "p50", num: true, text: (m) => ms(m.live.p50), sort: (m) => m.live.p50 },
    { label: "p99", num: true, text: (m) => ms(m.live.p99), sort: (m) => m.live.p99 },
    { label: "Mean batch", num: true, text: (m) => num(m.live.batch), sort: (m) => m.live.batch },
    { label: "Queued", num: true, text: (m) => String(m.live.queue || 0), sort: (m) => m.live.queue || 0 },
    // Generative models: output tokens/s, time to first token and inter-token latency (p50).
    { label: "Tok/s", num: true, text: (m) => (m.live.tps === undefined ? "–" : num(m.live.tps)), sort: (m) => m.live.tps },
    { label: "TTFT p50", num: true, text: (m) => (m.live.ttft50 === undefined ? "–" : ms(m.live.ttft50)), sort: (m) => m.live.ttft50 },
    { label: "ITL p50", num: true, text: (m) => (m.live.itl50 === undefined ? "–" : ms(m.live.itl50)), sort: (m) => m.live.itl50 },
  ], {
    countId: "models-count",
    rowClass: (m) => (m.name === state.selected ? "selected" : ""),
    onClick: (name) => select(state.selected === name ? null : name),
  });

  // ---- charts -----------------------------------------------------------------

  function agoLabel(s) {
    if (s === 0) return "now";
    const m = Math.floor(s / 60), r = Math.round(s % 60);
    return "-" + (m ? m + "m" : "") + (r ? r + "s" : "");
  }

  function niceCeil(v) {
    if (!(v > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * p >= v) return m * p;
    return 10 * p;
  }

  class Chart {
    constructor(id, lines) {
      this.canvas = $(id);
      this.lines = lines; // [{key, label, color}]
    }

    // The time axis spans the history there is, from one to five minutes.
    draw(h, now, span) {
      const canvas = this.canvas;
      const dpr = window.devicePixelRatio || 1;
      const w = canvas.clientWidth, hgt = canvas.clientHeight;
      if (!w || !hgt) return;
      if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(hgt * dpr)) {
        canvas.width = Math.round(w * dpr);
        canvas.height = Math.round(hgt * dpr);
      }
      const ctx = canvas.getContext("2d");
      ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
      ctx.clearRect(0, 0, w, hgt);
      const left = 46, right = 8, top = 18, bottom = 18;
      const pw = w - left - right, ph = hgt - top - bottom;
      const t0 = now - span;
      let ymax = 0;
      if (h) {
        for (const line of this.lines) {
          h[line.key].forEach((v, i) => { if (v !== null && h.t[i] >= t0 && v > ymax) ymax = v; });
        }
      }
      ymax = niceCeil(ymax);
      const x = (t) => left + ((t - t0) / span) * pw;
      const y = (v) => top + ph - (v / ymax) * ph;

      ctx.font = "11px system-ui, sans-serif";
      ctx.strokeStyle = "#e2e5eb";
      ctx.fillStyle = "#6b7385";
      ctx.lineWidth = 1;
      ctx.textAlign = "right";
      ctx.textBaseline = "middle";
      for (let i = 0; i <= 4; i += 1) {
        const v = (ymax * i) / 4;
        const yy = Math.round(y(v)) + 0.5;
        ctx.beginPath(); ctx.moveTo(left, yy); ctx.lineTo(left + pw, yy); ctx.stroke();
        ctx.fillText(num(v), left - 6, yy);
      }
      ctx.textBaseline = "top";
      const step = [10, 15, 30, 60].find((s) => span / s <= 6) || 60;
      for (let ago = 0; ago <= span + 0.001; ago += step) {
        ctx.textAlign = ago === 0 ? "right" : ago + step > span ? "left" : "center";
        ctx.fillText(agoLabel(ago), x(now - ago), top + ph + 4);
      }
      ctx.textAlign = "left";
      let lx = left;
      for (const line of this.lines) {
        ctx.fillStyle = line.color;
        ctx.fillText(line.label, lx, 2);
        lx += ctx.measureText(line.label).width + 14;
        if (!h) continue;
        ctx.strokeStyle = line.color;
        ctx.lineWidth = 1.5;
        ctx.beginPath();
        let pen = false;
        const vals = h[line.key];
        for (let i = 0; i < h.t.length; i += 1) {
          const v = vals[i];
          if (v === null || h.t[i] < t0) { pen = false; continue; }
          if (pen) ctx.lineTo(x(h.t[i]), y(v));
          else { ctx.moveTo(x(h.t[i]), y(v)); pen = true; }
        }
        ctx.stroke();
      }
    }
  }

  const charts = [
    new Chart("chart-rps", [{ key: "rps", label: "requests/s", color: COLORS.a }, { key: "eps", label: "errors/s", color: COLORS.b }]),
    new Chart("chart-latency", [{ key: "p50", label: "p50", color: COLORS.a }, { key: "p99", label: "p99", color: COLORS.b }]),
    new Chart("chart-batch", [{ key: "batch", label: "mean batch", color: COLORS.c }, { key: "queue", label: "queued", color: COLORS.d }]),
  ];

  function drawCharts() {
    const snaps = state.snapshots;
    const now = snaps.length ? snaps[snaps.length - 1].t : Date.now() / 1000;
    const h = state.history.get(state.selected === null ? "" : state.selected);
    const first = state.history.has("") ? state.history.get("").t[0] : now;
    const span = Math.min(HISTORY_S, Math.max(60, Math.ceil((now - first) / 60) * 60));
    for (const c of charts) c.draw(h, now, span);
  }

  // ---- rendering ------------------------------------------------------------------

  function setText(id, text) {
    const el = $(id);
    if (el.textContent !== text) el.textContent = text;
  }

  function select(name) {
    state.selected = name;
    setText("chart-scope", name === null ? "all models" : name);
    $("scope-all").hidden = name === null;
    renderModels();
    drawCharts();
  }

  // An ejected worker's badge says why and until when; a down one, its last probe error.
  function whyState(w) {
    const e = w.ejection;
    if (w.state !== "ejected" || !e) return w.last_error || "";
    const until = new Date(e.until * 1000).toLocaleTimeString();
    const since = new Date(e.since * 1000).toLocaleTimeString();
    return `ejected since ${since} until ${until} (circuit ${e.circuit}): ${e.reason}`;
  }

  function renderWorkers() {
    if (!state.cluster) return;
    workersTable.update(state.cluster.workers.map((w) => {
      const live = state.liveWorkers.get(w.address);
      return {
        key: w.address,
        address: w.address,
        state: w.state,
        kind: w.kind,
        models: w.models,
        why: whyState(w),
        inflight: live ? live.inflight : w.load.inflight_batches,
        failures: live ? live.failures : w.load.failures,
        retries: live ? live.retries : w.load.retries,
        sentRate: live ? live.sentRate : null,
        dev: deviceSummary(w.devices || []),
        search: `${w.address} ${w.state} ${w.kind}`.toLowerCase(),
      };
    }));
    const ready = state.cluster.workers.filter((w) => w.state === "ready").length;
    setText("tile-workers", `${ready} / ${state.cluster.workers.length}`);
  }

  function renderGeneration() {
    if (!state.cluster) return;
    const rows = [];
    const add = (worker, models) => {
      for (const [model, g] of Object.entries(models || {})) {
        rows.push({ key: `${worker} ${model}`, worker, model, ...g, search: `${worker} ${model}`.toLowerCase() });
      }
    };
    for (const w of state.cluster.workers) add(w.address, w.generation);
    add("gateway", state.cluster.gateway_generation);
    $("generation-panel").hidden = rows.length === 0;
    generationTable.update(rows);
  }

  function renderModels() {
    if (!state.cluster) return;
    const empty = { rps: null, eps: null, p50: null, p99: null, batch: null, queue: 0 };
    modelsTable.update(state.cluster.models.map((m) => ({
      key: m.name,
      name: m.name,
      state: m.state,
      versions: m.versions,
      replicas: m.replicas,
      max_batch_size: m.max_batch_size,
      live: state.live.get(m.name) || empty,
      search: `${m.name} ${m.state}`.toLowerCase(),
    })));
    const ready = state.cluster.models.filter((m) => m.state === "ready").length;
    setText("tile-models", `${ready} / ${state.cluster.models.length}`);
  }

  function renderTiles() {
    const t = state.total;
    if (!t) return;
    setText("tile-rps", num(t.rps));
    setText("tile-eps", num(t.eps));
    setText("tile-p50", ms(t.p50));
    setText("tile-p99", ms(t.p99));
    setText("tile-batch", num(t.batch));
    setText("tile-queue", String(t.queue));
  }

  function setStatus(kind, text) {
    const el = $("status");
    el.className = "status " + kind;
    setText("status", text);
  }

  // ---- polling --------------------------------------------------------------------

  async function getJson(path) {
    const response = await fetch(path, { cache: "no-store", headers: { Accept: "application/json" } });
    if (!response.ok) throw new Error(`${path}: HTTP ${response.status}`);
    return response.json();
  }

  function bump(name) {
    document.body.dataset[name] = String(Number(document.body.dataset[name] || 0) + 1);
  }

  async function pollCluster() {
    if (!state.paused && !document.hidden) {
      try {
        state.cluster = await getJson("v2/cluster");
        setText("gw-version", "v" + state.cluster.gateway.version);
        renderWorkers();
        renderGeneration();
        renderModels();
        bump("clusterUpdates");
      } catch (err) {
        setStatus("bad", "cluster view unavailable: " + err.message);
      }
    }
    setTimeout(pollCluster, CLUSTER_MS);
  }

  async function pollStats() {
    if (!state.paused && !document.hidden) {
      try {
        onStats(await getJson("v2/cluster/stats"));
        renderTiles();
        renderWorkers();
        renderGeneration();
        renderModels();
        drawCharts();
        setStatus("ok", "live · " + new Date().toLocaleTimeString());
        bump("statsUpdates");
      } catch (err) {
        setStatus("bad", "gateway unreachable: " + err.message);
      }
    }
    setTimeout(pollStats, STATS_MS);
  }

  $("pause").addEventListener("click", () => {
    state.paused = !state.paused;
    $("pause").textContent = state.paused ? "Resume" : "Pause";
    $("pause").setAttribute("aria-pressed", String(state.paused));
    if (state.paused) setStatus("paused", "paused");
  });
  $("scope-all").addEventListener("click", () => select(null));
  $("workers-filter").addEventListener("input", (ev) => workersTable.setFilter(ev.target.value));
  $("models-filter").addEventListener("input", (ev) => modelsTable.setFilter(ev.target.value));
  window.addEventListener("resize", drawCharts);

  pollCluster();
  pollStats();
})();
