"""``python -m thunder_memopt.launch``, under torchrun (two ranks, CPU): an unmodified Thunder program
(``PROGRAM``, written to a temporary file) gets MemoryOptimization first and thunder_memopt's
executors in front in its thunder.jit and its ThunderCompiler, with the options of the flags and
the environment; the options are printed once. Bad options are refused with argparse's one-line
error, in process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from thunder_memopt import launch
from thunder_memopt.options import EXECUTOR_OPTIONS, MEMORY_OPTIONS

PROGRAM = '''
import json, os, sys
import thunder, torch
from thunder.dynamo import ThunderCompiler

model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
jitted = thunder.jit(model, executors=["torch"])
jitted(torch.randn(4, 16)).sum().backward()
backend = ThunderCompiler()
torch.compile(model, backend=backend)(torch.randn(4, 16)).sum().backward()

def seen(data):
    first = data.transforms[0] if data.transforms else None
    executors = [e.name for e in data.executors_list if not e.name.startswith("__ad_hoc")]
    return {"transforms": [repr(t) for t in data.transforms], "executors": executors,
            "passes_ran": sorted(getattr(first, "pass_seconds", {}))}

(region,) = [fn for info in backend.subgraph_infos for fn in info.thunder_compiled_fns]
print("SEEN " + json.dumps({"rank": os.environ["RANK"], "argv": sys.argv, "name": __name__,
                            "jit": seen(thunder.compile_data(jitted)), "compiler": seen(thunder.compile_data(region))}))
'''


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> subprocess.CompletedProcess:
    script = tmp_path_factory.mktemp("launch") / "program.py"
    script.write_text(PROGRAM)
    env = {**os.environ, "THUNDER_MEMOPT_ACTIVATION_BUDGET": "0.2",
           "THUNDER_MEMOPT_CUDNN_ATTENTION": "false", "THUNDER_MEMOPT_TYPO": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "thunder_memopt.launch", "--activation-budget", "0.5", str(script), "--steps", "1"]
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300,
                              cwd=Path(__file__).resolve().parents[1])
    assert finished.returncode == 0, finished.stdout[-3000:] + finished.stderr[-3000:]
    return finished


def test_every_thunder_jit_and_thunder_compiler_gets_the_plugin(launched):
    seen = [json.loads(line.removeprefix("SEEN ")) for line in launched.stdout.splitlines() if line.startswith("SEEN ")]
    assert sorted(s["rank"] for s in seen) == ["0", "1"]
    for s in seen:
        assert s["name"] == "__main__" and s["argv"][1:] == ["--steps", "1"] and s["argv"][0].endswith("program.py")
        for made in (s["jit"], s["compiler"]):
            # The flag wins over the variable: budget 0.5; the MemoryOptimization first, and it ran.
            assert made["transforms"][0].startswith("MemoryOptimization(activation_budget=0.5,"), made
            assert "recompute" in made["passes_ran"], made
            # cuDNN attention off by its variable; the loss head and the fusion executor in front.
            assert made["executors"][:2] == ["memopt_linear_cross_entropy", "memopt_fusion"], made
            assert "memopt_cudnn_attention" not in made["executors"]
        assert "torch" in s["jit"]["executors"]  # the executor the program gave stays, behind


def test_the_options_are_printed_once(launched):
    banners = [line for line in launched.stderr.splitlines() if line.startswith("thunder_memopt.launch: ")]
    assert len(banners) == 2, launched.stderr[-3000:]
    assert "activation_budget=0.5" in banners[0] and "program.py" in banners[0]
    assert banners[1] == "thunder_memopt.launch: THUNDER_MEMOPT_TYPO is not an option's variable, not read"


def test_every_option_but_the_rates_has_a_flag():
    assert set(launch.FLAGS) == (set(MEMORY_OPTIONS) - {"offload_rates"}) | set(EXECUTOR_OPTIONS)


@pytest.mark.parametrize(("argv", "environ", "names"), [
    (["--activation-budget", "2", "{script}"], {}, "--activation-budget"),
    (["--offload", "sometimes", "{script}"], {}, "--offload"),
    (["--fusion", "yes", "{script}"], {}, "--fusion"),
    (["--budget", "0.5", "{script}"], {}, "--budget"),
    (["{script}"], {"THUNDER_MEMOPT_OFFLOAD_BUDGET": "half"}, "THUNDER_MEMOPT_OFFLOAD_BUDGET"),
    (["--offload-budget", "0.5", "{script}"], {}, "offload_budget"),
    (["--host-memory-limit", "0.5", "{script}"], {}, "--host-memory-limit"),
    (["--memory-limit", "1GiB", "--over-limit", "warn", "{script}"], {}, "--over-limit"),
    (["--memory-limit", "1GiB", "{script}"], {"THUNDER_MEMOPT_OVER_LIMIT": "never"}, "THUNDER_MEMOPT_OVER_LIMIT"),
    (["--over-limit", "lowest", "{script}"], {}, "over_limit='lowest' applies to memory_limit"),  # no limit
    (["--cap-allocator", "false", "{script}"], {}, "cap_allocator=False applies to memory_limit"),  # no limit
    (["--memory-limit", "1GiB", "--cap-allocator", "no", "{script}"], {}, "--cap-allocator"),
    (["no_such_program.py"], {}, "no_such_program.py"),
    ([], {}, "script"),
])
def test_bad_options_are_refused_in_one_line(argv, environ, names, tmp_path, monkeypatch, capsys):
    script = tmp_path / "program.py"
    script.write_text("raise SystemExit('the program ran')\n")
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exited:
        launch.main([a.format(script=script) for a in argv])
    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"{launch.PROG}: error: ") and names in error, error
