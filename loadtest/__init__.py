"""The load-test harness behind ``infergate bench`` (perf_analyzer style) and
the benchmark suite behind ``make bench`` (``suite*`` modules).

May import: ``protos`` and the client libraries; never the servers' packages,
so it measures any KServe v2 server the same way.
"""
