"""The README's instructions for serving a repository without ``config.pbtxt``,
followed as written.

The shell block after the README's ``readme-test: serve-repository-without-config``
marker is read from README.md itself, so the instructions and this test cannot
drift apart: its ``mkdir``/``cp`` lines build the repository in a temporary
directory (``models/`` is the example repository, built fresh for the session),
its ``infergate up`` command is started as a real process on free ports, and
one request through tritonclient is compared with ONNX Runtime run in-process
on the same file and input.
"""

from __future__ import annotations

import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import tritonclient.grpc as grpcclient
from tritonclient.utils import triton_to_np_dtype

from tests.harness import ROOT, start

MARKER = "<!-- readme-test: serve-repository-without-config -->"
READY_TIMEOUT_S = 60.0
ROWS = 3  # within the auto-completed max_batch_size the README states


@dataclass(frozen=True, slots=True)
class Instructions:
    """What the README's block does: the directories it makes, the files it copies, the command it runs."""

    directories: tuple[str, ...]
    copies: tuple[tuple[str, str], ...]
    up_args: tuple[str, ...]


def readme_text() -> str:
    return (ROOT / "README.md").read_text()


def read_instructions(text: str) -> Instructions:
    """Parse the shell block that follows the marker; any line this test cannot follow fails it."""
    assert MARKER in text, f"README.md has lost its marker {MARKER!r}"
    block = re.match(r"\s*```sh\n(.*?)```", text.split(MARKER, 1)[1], re.S)
    assert block, "the README's marker is not followed by a ```sh block"
    directories: list[str] = []
    copies: list[tuple[str, str]] = []
    up_args: tuple[str, ...] = ()
    for line in block.group(1).splitlines():
        words = shlex.split(line)
        if not words:
            continue
        if words[:2] == ["mkdir", "-p"] and len(words) == 3:
            directories.append(words[2])
        elif words[0] == "cp" and len(words) == 3:
            copies.append((words[1], words[2]))
        elif Path(words[0]).name == "infergate" and words[1:2] == ["up"]:
            up_args = tuple(words[1:])
        else:
            raise AssertionError(f"the README's block has a line this test does not follow: {line!r}")
    assert up_args, "the README's block runs no `infergate up`"
    return Instructions(tuple(directories), tuple(copies), up_args)


def follow(instructions: Instructions, workdir: Path, model_repo: Path) -> list[str]:
    """Make the block's directories and copies under ``workdir``; the ``up`` arguments with paths made absolute."""
    for directory in instructions.directories:
        (workdir / directory).mkdir(parents=True, exist_ok=True)
    for source, target in instructions.copies:
        relative = Path(source).relative_to("models")  # the example repository, as `make` builds it
        shutil.copyfile(model_repo / relative, workdir / target)
    args = list(instructions.up_args)
    flag = args.index("--model-repository")
    args[flag + 1] = str(workdir / args[flag + 1])
    # Free ports instead of 8000/8001; argparse keeps the last value of a repeated flag.
    return [*args, "--http-port", "0", "--grpc-port", "0"]


def test_instructions_are_what_the_test_follows() -> None:
    instructions = read_instructions(readme_text())
    assert len(instructions.copies) == 1
    source, target = instructions.copies[0]
    assert source.endswith("/1/model.onnx") and target.endswith("/1/model.onnx")
    assert "--model-repository" in instructions.up_args
    assert all(Path(copied).name != "config.pbtxt" for _, copied in instructions.copies)


def test_repository_without_config_serves_as_the_readme_says(tmp_path: Path, model_repo: Path) -> None:
    text = readme_text()
    instructions = read_instructions(text)
    args = follow(instructions, tmp_path, model_repo)
    repository = Path(args[args.index("--model-repository") + 1])
    target = tmp_path / instructions.copies[0][1]
    model = target.parent.parent.name
    assert target.parent.parent.parent == repository
    assert not list(repository.rglob("config.pbtxt")), "the README's repository must have no config.pbtxt"

    proc = start(args)
    try:
        with grpcclient.InferenceServerClient(f"127.0.0.1:{proc.ready['grpc_port']}") as client:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not client.is_model_ready(model):
                assert time.monotonic() < deadline, f"model {model!r} not ready:\n{proc.log()[-4000:]}"
                time.sleep(0.1)  # polling a condition, not standing in for it

            config = client.get_model_config(model, as_json=True)["config"]
            # What the README says auto-complete chooses for this model.
            assert int(config["max_batch_size"]) == 4 and "`max_batch_size: 4`" in text
            assert ROWS <= int(config["max_batch_size"])

            session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
            metadata = client.get_model_metadata(model, as_json=True)
            rng = np.random.default_rng(7)
            feeds: dict[str, np.ndarray] = {}
            inputs = []
            for tensor in metadata["inputs"]:
                shape = [ROWS, *(int(d) for d in tensor["shape"][1:])]
                array = rng.standard_normal(shape).astype(triton_to_np_dtype(tensor["datatype"]))
                feeds[tensor["name"]] = array
                item = grpcclient.InferInput(tensor["name"], shape, tensor["datatype"])
                item.set_data_from_numpy(array)
                inputs.append(item)
            result = client.infer(model, inputs)

            names = [t["name"] for t in metadata["outputs"]]
            expected = session.run(names, feeds)
            for name, want in zip(names, expected):
                got = result.as_numpy(name)
                assert got is not None and got.shape == want.shape, (name, None if got is None else got.shape)
                np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    finally:
        proc.stop()
