"""Servers of bench_rollout.py's arms: a `python -m sglang.launch_server` started for an arm (its
own process group, stopped with it), and the check that a given server runs what its arm measures."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import stop_process_group

# the server_args fields each arm needs on (checked through /get_server_info)
ARM_FLAGS = {"plain": (), "eagle": (), "switch": ("speculative_switch",),
             "switch-cotrain": ("speculative_switch", "drafter_cotrain")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_flags(kwargs: dict) -> list[str]:
    """Engine keywords as launch_server flags (True: the bare flag; False and None: left out)."""
    flags: list[str] = []
    for key, value in kwargs.items():
        if value is None or value is False:
            continue
        flags.append("--" + key.replace("_", "-"))
        if value is not True:
            flags.append(str(value))
    return flags


class Launched:
    """A `python -m sglang.launch_server` process of one arm, its own process group."""

    def __init__(self, arm: str, flags: list[str], log_dir: Path, cpu: bool, timeout: float = 900.0) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log = log_dir / f"rollout-{arm}-{port}.log"
        # on a CPU: one OpenMP thread (a shared box's cores), EAGLE's small helpers run eagerly (faster start)
        cpu_env = {"SGLANG_USE_CPU_ENGINE": "1", "TORCHDYNAMO_DISABLE": "1",
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        env = {**os.environ, **(cpu_env if cpu else {})}
        cmd = [sys.executable, "-m", "sglang.launch_server", *flags, "--host", "127.0.0.1", "--port", str(port),
               "--nccl-port", str(free_port())]
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        t = time.perf_counter()
        try:
            self._wait(arm, flags, timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = round(time.perf_counter() - t, 1)

    def _wait(self, arm: str, flags: list[str], timeout: float) -> None:
        import requests

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                text = self.log.read_text(errors="replace")
                unknown = [line for line in text.splitlines() if "unrecognized arguments" in line]
                if unknown:
                    raise SystemExit(f"arm {arm}: the server does not know {unknown[-1].split(':', 2)[-1].strip()} "
                                     f"(see {self.log})")
                last = (text.strip().splitlines() or ["(empty log)"])[-1]
                raise SystemExit(f"arm {arm}: the server exited with {self.proc.returncode}: {last} (see {self.log})")
            try:
                if requests.get(self.url + "/health_generate", timeout=60).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise SystemExit(f"arm {arm}: the server was not healthy after {timeout:.0f} s (see {self.log})")

    def stop(self) -> None:
        stop_process_group(self.proc, 30)


def check_server(arm: str, url: str) -> dict:
    """The server's info; a one-line exit when it does not run what the arm measures."""
    import requests

    info = requests.get(url + "/get_server_info", timeout=60).json()
    speculative = bool(info.get("speculative_algorithm"))
    if speculative != (arm != "plain"):
        raise SystemExit(f"arm {arm}: the server at {url} runs speculative_algorithm="
                         f"{info.get('speculative_algorithm')}")
    missing = [flag for flag in ARM_FLAGS[arm] if not info.get(flag)]
    if missing:
        raise SystemExit(f"arm {arm}: the server at {url} does not run --{missing[0].replace('_', '-')}")
    return info
