"""What the benchmark scripts share (``benchmarks/`` is their import root).

* :mod:`common.processes`: the subprocesses of a run, each in its own process group;
* :mod:`common.servers`: ZooKeeper as measured, ``redis-server``, a private RabbitMQ node,
  and the production shape: a three-member ensemble and a RabbitMQ cluster of three
  (quorum queues), each member on a host of its own (:mod:`common.net`);
* :mod:`common.worker` and :mod:`common.app`: ``celery worker`` processes and their app;
* :mod:`common.load`: the steady load of the loaded shapes, and the server's warm-up;
* :mod:`common.latency`: one-way, ``delay().get()`` and reply round-trip latency;
* :mod:`common.tally`, :mod:`common.machine`, :mod:`common.txnlog`: a drain's tasks,
  the machine's CPU and ZooKeeper's failed transactions, counted;
* :mod:`common.figures`, :mod:`common.report`: percentiles, tables, and ``workers.py``'s
  report; :mod:`common.spans`: overlaps, for ``limits.py``.
"""
