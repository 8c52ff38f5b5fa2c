"""The public path of data-affinity scheduling: ``celery_zk.affinity``, the
module :mod:`celery_zk.features.affinity` itself (not a copy: its worker id
and held keys are module state)."""
import sys

from .features import affinity as _affinity

sys.modules[__name__] = _affinity
