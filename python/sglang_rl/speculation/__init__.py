"""The speculation switch: drafting on only where it pays (engine-agnostic core, no sglang import).

`BreakEvenTable` holds, per running batch size, the tokens per verify step at which speculative
decoding starts to beat plain decoding; `SpeculationSwitch` decides per decode step from the batch
size and the server's rolling acceptance, and probes drafting again every so often while off.
"""

from sglang_rl.speculation.catch_up import OffRows, plan_chunks
from sglang_rl.speculation.switch import SpeculationSwitch, SwitchConfig
from sglang_rl.speculation.table import DEFAULT_TABLE, BreakEvenTable

__all__ = ["BreakEvenTable", "DEFAULT_TABLE", "OffRows", "SpeculationSwitch", "SwitchConfig", "plan_chunks"]
