"""Always-on monitoring: :func:`watch` a model, get an :class:`Incident` naming the first module,
phase and step where values went non-finite, and a :class:`Ledger` of AMP updates."""
from nanscan.monitor.distributed import all_reduce_records
from nanscan.monitor.incident import Incident, NonFiniteError
from nanscan.monitor.ledger import Ledger
from nanscan.monitor.api import watch
from nanscan.monitor.config import WatchConfig
from nanscan.monitor.monitor import Monitor
from nanscan.monitor.spikes import SpikeEvent, SpikePolicy, SpikeWarning

__all__ = ["all_reduce_records", "Incident", "Ledger", "Monitor", "NonFiniteError", "SpikeEvent", "SpikePolicy",
           "SpikeWarning", "WatchConfig", "watch"]
