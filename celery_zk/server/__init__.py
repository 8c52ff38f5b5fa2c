"""A local ZooKeeper: the launcher (:mod:`.launcher`), finding an installation
(:mod:`.install`) and ensembles (:mod:`.ensemble`).

``from celery_zk.server import ZooKeeperServer`` (and ``ZooKeeperEnsemble``)
is the public path.
"""
from .ensemble import ZooKeeperEnsemble
from .install import JVM_FLAGS, SERVER_JVM_FLAGS, ZooKeeperInstall, find_zookeeper
from .launcher import (
    Peer,
    TLSConfig,
    ZooKeeperServer,
    four_letter_word,
    free_ports,
    render_config,
)

__all__ = ["JVM_FLAGS", "SERVER_JVM_FLAGS", "Peer", "TLSConfig", "ZooKeeperEnsemble",
           "ZooKeeperInstall", "ZooKeeperServer", "find_zookeeper", "four_letter_word",
           "free_ports", "render_config"]
