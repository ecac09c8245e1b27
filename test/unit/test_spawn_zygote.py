"""The test servers' spawn zygote (test/spawn_zygote.py): a spawned target runs in the zygote's
child with the arguments, environment, exit code and signals a spawned process has; anything else
is spawned as always."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TEST_DIR = Path(__file__).resolve().parents[1]

SCENARIO = r'''
import json, multiprocessing, os, signal, sys, tempfile, time


def report(conn, code):
    conn.send({"ppid": os.getppid(), "env": os.environ.get("ZYGOTE_TEST"), "preloaded": "colorsys" in sys.modules})
    sys.exit(code)


def wait_forever(conn):
    conn.send("up")
    time.sleep(60)


def other(conn):
    conn.send({"ppid": os.getppid(), "preloaded": "colorsys" in sys.modules})


if __name__ == "__main__":
    sys.path.insert(0, sys.argv[1])
    import spawn_zygote

    folder = tempfile.mkdtemp()
    zygote = spawn_zygote.start(spawn_zygote.write_client(folder), os.path.join(folder, "z.sock"),
                                preload=("colorsys",), targets={("__main__", "report"), ("__main__", "wait_forever")})
    multiprocessing.set_start_method("spawn", force=True)
    os.environ["ZYGOTE_TEST"] = "set after the zygote started"
    out = {"parent": os.getpid(), "zygote": zygote}
    for name, target, args in (("report", report, (3,)), ("other", other, ())):
        mine, theirs = multiprocessing.Pipe(duplex=False)
        proc = multiprocessing.Process(target=target, args=(theirs, *args))
        proc.start()
        out[name] = mine.recv()
        proc.join(30)
        out[name + "_exitcode"] = proc.exitcode
    mine, theirs = multiprocessing.Pipe(duplex=False)
    proc = multiprocessing.Process(target=wait_forever, args=(theirs,))
    proc.start()
    mine.recv()
    proc.terminate()
    proc.join(30)
    out["terminated_exitcode"] = proc.exitcode
    print(json.dumps(out))
'''


def test_targets_run_in_the_zygotes_children_as_spawned_processes(tmp_path: Path) -> None:
    script = tmp_path / "scenario.py"
    script.write_text(SCENARIO)
    run = subprocess.run([sys.executable, str(script), str(TEST_DIR)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    report = out["report"]
    assert report["ppid"] == out["zygote"] and report["preloaded"]  # forked from the zygote, imports ready
    assert report["env"] == "set after the zygote started"  # the spawning process's environment
    assert out["report_exitcode"] == 3
    assert out["terminated_exitcode"] == -15  # SIGTERM reaches the process, its death reads as a spawn's
    other = out["other"]
    assert other["ppid"] == out["parent"] and not other["preloaded"] and out["other_exitcode"] == 0
