"""The nemesis: real partitions, kills and pauses under a steady Celery load on zk://.

Run it as ``sudo .venv/bin/python benchmarks/nemesis --short`` (docs/nemesis.md).
:mod:`nemesis.run` is the harness; :mod:`common.net` and :mod:`nemesis.cluster`
its machines; :mod:`nemesis.app` and :mod:`nemesis.publisher` the load;
:mod:`nemesis.schedule`, :mod:`nemesis.faults` and :mod:`nemesis.dispatcher` the
faults; :mod:`nemesis.history`, :mod:`nemesis.checker`, :mod:`nemesis.state` and
:mod:`nemesis.recovery` what is recorded and what it must show.
"""
