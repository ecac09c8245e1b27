"""The verl activation hook and the rollout records verl's server reads.

The hook is run in a fresh interpreter, as Ray runs it in a worker: it must load sglang's plugins
before verl's sglang server module executes, and make verl's own rollout registry give the
sglang-rl replica for `sglang`, without importing either module itself.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang_rl.adapters import rollout_records
from sglang_rl.request_options import FINGERPRINTS_FIELD

# each runs in a fresh interpreter, both at once (importing verl takes seconds); the tests read the outputs
SCRIPTS = {
    "lazily": (
        "import sys\n"
        "from sglang_rl.integrations.verl.activate import load_plugins_first\n"
        "load_plugins_first()\n"
        "print('imported before:', 'verl.workers.rollout.replica' in sys.modules, 'sglang' in sys.modules,\n"
        "      'verl.trainer.ppo.v1' in sys.modules)\n"
        "from verl.workers.rollout.replica import get_rollout_replica_class\n"
        "cls = get_rollout_replica_class('sglang')\n"
        "print('replica:', cls.__name__, cls.__mro__[1].__name__)\n"
        "import verl.workers.rollout.sglang_rollout.async_sglang_server as m\n"
        "print('server args:', m.ServerArgs.__name__)\n"
        "args = m.ServerArgs(model_path=sys.argv[1], toploc_verification=True)\n"  # as verl builds them
        "print('flag taken:', args.toploc_verification)\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"  # what verl's TaskRunnerV1 calls
        "cls = get_trainer_cls('sglang_rl_sync')\n"
        "print('trainer:', cls.__name__, cls.__mro__[1].__name__)\n"
        "print('sync untouched:', get_trainer_cls('sync').__name__)\n"
    ),
    # verl imported first: without the hook it knows neither the trainer nor the flags; then the hook
    "after_import": (
        "import sys\n"
        "import verl.workers.rollout.replica as r\n"
        "from verl.trainer.ppo.v1 import get_trainer_cls\n"
        "import verl.workers.rollout.sglang_rollout.async_sglang_server as m\n"
        "try:\n"
        "    get_trainer_cls('sglang_rl_sync')\n"
        "except ValueError as exc:\n"
        "    print('refused:', exc)\n"
        "try:\n"
        "    m.ServerArgs(model_path=sys.argv[1], toploc_verification=True)\n"
        "except TypeError as exc:\n"
        "    print('flag refused:', exc)\n"
        "from sglang_rl.integrations.verl.activate import load_plugins_first\n"
        "load_plugins_first()\n"
        "load_plugins_first()\n"  # twice: registered once, verl's loader kept underneath
        "loader = r.RolloutReplicaRegistry._registry['sglang']\n"
        "print('wraps verl:', loader.__closure__[0].cell_contents.__name__)\n"
        "print('replica:', r.get_rollout_replica_class('sglang').__name__)\n"
        "print('vllm untouched:', r.RolloutReplicaRegistry._registry['vllm'].__name__)\n"
        "print('trainer after:', get_trainer_cls('sglang_rl_sync').__name__)\n"
    ),
}


@pytest.fixture(scope="module")
def scripts_run(model_path: str) -> dict[str, str]:
    procs = {name: subprocess.Popen([sys.executable, "-c", code, model_path], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True) for name, code in SCRIPTS.items()}
    outputs = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, (name, err[-3000:])
        outputs[name] = out
    return outputs


def test_hook_registers_the_replica_and_the_trainer_lazily(scripts_run: dict) -> None:
    out = scripts_run["lazily"]
    assert "imported before: False False False" in out, out
    assert "replica: SGLangRLReplica SGLangReplica" in out, out
    assert "server args: RLServerArgs" in out and "flag taken: True" in out, out
    assert "trainer: SGLangRLTrainerSync PPOTrainerSync" in out, out
    assert "sync untouched: PPOTrainerSync" in out, out


def test_hook_after_verl_was_imported_acts_at_once(scripts_run: dict) -> None:
    out = scripts_run["after_import"]
    assert "replica: SGLangRLReplica" in out and "vllm untouched: _load_vllm" in out, out
    assert "wraps verl: _load_sglang" in out, out
    assert "trainer after: SGLangRLTrainerSync" in out, out


def test_without_the_hook_verl_refuses_the_trainer_and_the_flags(scripts_run: dict) -> None:
    """The reason the hook exists: verl builds ServerArgs before sglang loads plugins."""
    out = scripts_run["after_import"]
    assert "refused: Unknown trainer 'sglang_rl_sync'" in out, out
    assert "flag refused:" in out and "toploc_verification" in out.split("flag refused:")[1].splitlines()[0], out


class _Manager:
    """Stands in for sglang's TokenizerManager: records live as an attribute on it."""


def _output(rid: str, finished: bool, **meta: object) -> dict:
    return {"meta_info": {"id": rid, "finish_reason": {"type": "stop"} if finished else None, **meta}}


def test_records_are_off_until_enabled_and_taken_once() -> None:
    manager = _Manager()
    rollout_records.record(manager, _output("a", True, **{FINGERPRINTS_FIELD: ["fp"]}))
    assert rollout_records.pop(manager, "a") == {}  # off: nothing kept
    rollout_records.enable(manager)
    rollout_records.record(manager, _output("a", False, **{FINGERPRINTS_FIELD: ["partial"]}))
    assert rollout_records.pop(manager, "a") == {}  # not finished yet
    rollout_records.record(manager, _output("a", True, spec_verify_ct=5, spec_num_correct_drafts=7,
                                            spec_num_proposed_drafts=15, spec_accept_length=2.4,
                                            **{FINGERPRINTS_FIELD: ["fp"]}))
    assert rollout_records.pop(manager, "a") == {
        FINGERPRINTS_FIELD: ["fp"], "spec_num_verify_steps": 5, "spec_num_accepted_tokens": 7,
        "spec_num_draft_tokens": 15}
    assert rollout_records.pop(manager, "a") == {}  # taken once


def test_records_stay_bounded() -> None:
    manager = _Manager()
    records = rollout_records.enable(manager, capacity=3)
    assert rollout_records.enable(manager) is records
    for i in range(5):
        rollout_records.record(manager, _output(f"r{i}", True, spec_verify_ct=i))
    assert len(records) == 3 and records.dropped == 2
    assert rollout_records.pop(manager, "r0") == {}
    assert rollout_records.pop(manager, "r4") == {"spec_num_verify_steps": 4}
