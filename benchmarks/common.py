"""What the benchmark scripts share: the machine they ran on, processes on loopback ports,
spreads and percentiles, tables and result files.

A script in this folder imports it as `from common import ...` (Python puts the script's
own folder first on sys.path); an experiment, run from the repository root as
`python -m benchmarks.experiments.NAME`, imports `benchmarks.common`. Standard library at
import time: TensorFlow never, rich and tokenserve only inside the functions that need them
(the peers' own virtualenvs run scripts that import this).
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
TOKENSERVE = str(Path(sys.executable).with_name("tokenserve"))

# -- the machine ------------------------------------------------------------------------------
# The ISA extensions that decide which oneDNN/XLA kernels run (bf16 and int8 paths included).
KEY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "avx_vnni")
# Variables that cap or switch the CPU kernels; recorded when set.
ENV_VARS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "XLA_FLAGS", "TF_ENABLE_ONEDNN_OPTS",
            "TF_XLA_FLAGS", "OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS",
            "TF_NUM_INTEROP_THREADS", "TOKENSERVE_KERNELS_MARCH", "TOKENSERVE_KERNELS",
            "TOKENSERVE_KERNELS_ISA")


def _fields(text: str, stop_at_blank: bool = False) -> dict[str, str]:
    """`key: value` lines (lscpu's, /proc/cpuinfo's) as a dict, the first of each key."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if stop_at_blank and not line.strip():
            break
        key, sep, value = line.partition(":")
        if sep and key.strip() not in fields:
            fields[key.strip()] = value.strip()
    return fields


def _lscpu() -> dict[str, str]:
    try:
        return _fields(subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10,
                                      env={**os.environ, "LC_ALL": "C"}).stdout)
    except (OSError, subprocess.SubprocessError):
        return {}


def _cpuinfo() -> dict[str, str]:
    """Where lscpu is missing: the first processor's entries in /proc/cpuinfo."""
    try:
        return _fields(Path("/proc/cpuinfo").read_text(), stop_at_blank=True)
    except OSError:
        return {}


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def machine_info() -> dict:
    """CPU model, flags (the key ones as booleans, plus the whole string), core counts, a
    container's CPU quota, platform and the ISA-capping environment variables that are set:
    what every result JSON records, since CPU figures depend on all of them."""
    from tokenserve.host.cpu_quota import cpu_quota

    lscpu = _lscpu()
    cpuinfo = {} if lscpu.get("Flags") and lscpu.get("Model name") else _cpuinfo()
    flags_str = lscpu.get("Flags") or cpuinfo.get("flags") or ""
    flags = set(flags_str.split())
    sockets = _int(lscpu.get("Socket(s)"))
    per_socket = _int(lscpu.get("Core(s) per socket"))
    quota = cpu_quota()
    return {
        "cpu_model": lscpu.get("Model name") or cpuinfo.get("model name"),
        "cpu_vendor": lscpu.get("Vendor ID") or cpuinfo.get("vendor_id"),
        "cpu_count": os.cpu_count(),  # logical CPUs
        "cpu_cores": sockets * per_socket if sockets and per_socket else None,  # physical
        "threads_per_core": _int(lscpu.get("Thread(s) per core")),
        "cpu_affinity": (len(os.sched_getaffinity(0))
                         if hasattr(os, "sched_getaffinity") else None),
        "cpu_quota": quota.cpus if quota is not None else None,  # --cpus, a k8s limit
        "hypervisor": lscpu.get("Hypervisor vendor"),
        "isa": {flag: flag in flags for flag in KEY_FLAGS},
        "cpu_flags": flags_str,
        "env": {name: os.environ[name] for name in ENV_VARS if name in os.environ},
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def isa_caps(env: dict[str, str]) -> list[str]:
    """The settings in `env` that cap or switch off CPU kernels, as short strings."""
    caps = [f"{name}={env[name]}" for name in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
            if name in env]
    for name in ("XLA_FLAGS", "TF_XLA_FLAGS"):
        caps += re.findall(r"--xla_cpu_max_isa=\S+", env.get(name, ""))
    caps += [f"{name}={env[name]}" for name in ("TF_ENABLE_ONEDNN_OPTS",
                                                "TOKENSERVE_KERNELS_MARCH", "TOKENSERVE_KERNELS",
                                                "TOKENSERVE_KERNELS_ISA")
             if env.get(name) is not None]
    return caps


def machine_summary(info: dict) -> str:
    """One line above a table, e.g. `CPU: AMD EPYC, 2 cores, avx2 avx512f avx512_bf16
    avx_vnni, no amx_bf16 (ISA not capped)`."""
    cores = info.get("cpu_cores") or info.get("cpu_count")
    count = f"{cores} cores"
    if info.get("cpu_count") and cores and info["cpu_count"] != cores:
        count += f" / {info['cpu_count']} threads"
    if info.get("cpu_affinity") and info["cpu_affinity"] != info.get("cpu_count"):
        count += f" ({info['cpu_affinity']} usable)"
    isa = info.get("isa", {})
    have = [flag for flag in KEY_FLAGS if isa.get(flag)]
    lack = [flag for flag in KEY_FLAGS if not isa.get(flag)]
    flags = " ".join(have) or "none of " + " ".join(KEY_FLAGS)
    if have and lack:
        flags += ", no " + " ".join(lack)
    caps = isa_caps(info.get("env", {}))
    capped = f"ISA capped: {', '.join(caps)}" if caps else "ISA not capped"
    return f"CPU: {info.get('cpu_model') or 'unknown'}, {count}, {flags} ({capped})"


# -- processes on loopback ports -------------------------------------------------------------
def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now: tokenserve.host.ports', imported
    here rather than at the top so this module stays standard library at import time."""
    from tokenserve.host.ports import free_port as port

    return port()


class Server:
    """A server in its own process, its stdout and stderr in a log file in the temp folder.

    `started` is taken before the process starts, so `wait_until_serving` returns the time
    to ready as a client sees it."""

    def __init__(self, command: list[str], url: str, log_name: str, env: dict | None = None,
                 ports: dict[str, int] | None = None):
        self.url, self.ports = url, ports or {}
        self.log_path = Path(tempfile.gettempdir()) / log_name
        self.started = time.monotonic()
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            env=env)

    def wait_until_serving(self, timeout_s: float, path: str = "/v1/models",
                           poll_s: float = 1.0, accept=None) -> float:
        """Seconds from start until GET `path` answers 200 (and `accept(response)` holds);
        raises once the process exits or `timeout_s` passes."""
        import httpx

        while time.monotonic() - self.started < timeout_s:
            try:
                answer = httpx.get(self.url + path, timeout=5)
                if answer.status_code == 200 and (accept is None or accept(answer)):
                    return time.monotonic() - self.started
            except httpx.HTTPError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"{Path(self.process.args[0]).name} exited with status "
                                   f"{self.process.returncode}; see {self.log_path}")
            time.sleep(poll_s)
        raise RuntimeError(f"no answer within {timeout_s:.0f} s; see {self.log_path}")

    def stop(self, timeout_s: float = 60) -> None:
        self.process.terminate()
        _wait_or_kill(self.process, timeout_s)

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(flags: list[str], log_name: str, env: dict | None = None) -> Server:
    """`tokenserve serve` with `flags`, on free loopback ports: `ports` holds "grpc", "rest"
    and "openai"; `url` is the OpenAI API's."""
    ports = {"grpc": free_port(), "rest": free_port(), "openai": free_port()}
    return Server([TOKENSERVE, "serve", "--port", str(ports["grpc"]), "--rest_api_port",
                   str(ports["rest"]), "--openai_port", str(ports["openai"]), *flags],
                  f"http://127.0.0.1:{ports['openai']}", log_name, env, ports)


class LineWorker:
    """A process driven a line at a time: a line to its stdin, a JSON line back on its
    stdout (stderr to `log_path`). Keeps its model loaded between requests."""

    def __init__(self, name: str, command: list[str], log_path: Path):
        self.name = name
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.log, text=True)

    def read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited; see {self.log.name}")
        return json.loads(line)

    def ask(self, line: str) -> dict:
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self.read()

    def stop(self, timeout_s: float = 60) -> None:
        self.process.stdin.close()  # its end of input: the worker exits
        _wait_or_kill(self.process, timeout_s)


def _wait_or_kill(process: subprocess.Popen, timeout_s: float) -> None:
    try:
        process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()


def rerun_command() -> list[str]:
    """The command that runs the current script again: `python -m NAME` for a module run
    with -m (an experiment), else `python PATH`."""
    main = sys.modules["__main__"]
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name != "__main__":
        return [sys.executable, "-m", spec.name]
    return [sys.executable, str(Path(main.__file__).resolve())]


def add_config_arguments(parser, configs: dict) -> None:
    """--configs: which ISA configurations to measure, each in a child process; and the
    child's own --child NAME and --child-output FILE (hidden)."""
    import argparse

    parser.add_argument("--configs", nargs="+", choices=list(configs), default=list(configs))
    parser.add_argument("--child", choices=list(configs), help=argparse.SUPPRESS)
    parser.add_argument("--child-output", type=Path, help=argparse.SUPPRESS)


def run_child(args: list[str], env: dict[str, str]) -> dict:
    """Runs this script again with `args` and `--child-output FILE` in a child process whose
    environment adds `env` (ISA caps must be set before TensorFlow loads); returns the JSON
    the child wrote to FILE."""
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp, "result.json")
        subprocess.run([*rerun_command(), *args, "--child-output", str(output)],
                       env={**os.environ, **env}, check=True)
        return json.loads(output.read_text())


def measure_configs(configs: list[str], run_config, table, report: dict, output: Path) -> None:
    """For each configuration: `run_config(name)` (its child's result, kept in
    report["configs"]), what it ran on and `table(name, result)` printed; then the report
    written to `output`."""
    console = make_console(160)
    for name in configs:
        report["configs"][name] = result = run_config(name)
        console.print(machine_summary(result["machine"]), markup=False)
        console.print(f"{result['kernel_status']}; load average "
                      f"{result['loadavg_before'][0]:.1f} -> {result['loadavg_after'][0]:.1f}",
                      markup=False)
        console.print(table(name, result))
    write_json(output, report)
    console.print(f"wrote {output}")


# -- figures ---------------------------------------------------------------------------------
def size_pair(text: str) -> tuple[int, int]:
    """"768x2304" -> (768, 2304): a shape on the command line."""
    first, second = text.lower().split("x")
    return int(first), int(second)



def spread(values) -> dict:
    """{"median", "min", "max"} of `values`: what a run of rounds is quoted as."""
    values = list(values)
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def percentiles(values, qs=(50, 95, 99)) -> dict:
    """{"p50": ..., "p95": ..., "p99": ...} of `values` (numpy's linear interpolation)."""
    import numpy as np

    return {f"p{q}": float(np.percentile(values, q)) for q in qs}


def rotated(items: list, round_index: int) -> list:
    """`items` starting at round_index (mod its length): the order of one round, so that a
    slow minute of a shared machine falls on every system in turn."""
    shift = round_index % len(items)
    return items[shift:] + items[:shift]


# -- tables, plots and result files -----------------------------------------------------------
def make_console(width: int = 150):
    """A rich Console: the terminal's width, or `width` when the output is a file or a pipe
    (where rich would assume 80 and wrap the tables)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else width)


def make_table(title: str, columns, left=(), caption: str | None = None,
               no_wrap: bool = False):
    """A rich Table with `columns`, right-justified (figures) except those named in `left`."""
    from rich.table import Table

    out = Table(title=title, caption=caption)
    for column in columns:
        out.add_column(column, justify="left" if column in left else "right", no_wrap=no_wrap)
    return out


def pyplot():
    """matplotlib.pyplot on the Agg backend (PNG files, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def result_path(stem: str, name: str = "", suffix: str = ".json") -> Path:
    """benchmarks/results/STEM[-NAME].json."""
    return RESULTS / f"{stem}{'-' + name if name else ''}{suffix}"


def output_name(benchmark: str, model: str | None, quick: bool) -> str:
    """`decode.json`, `decode-quick.json`, or with --model `decode-<its name>[-quick].json`,
    so a run on another model never overwrites the GPT-2 results."""
    stem = benchmark
    if model is not None:
        path = Path(model)
        name = path.parent.name if path.name.isdigit() else path.name  # a version dir
        stem += "-" + ("".join(c if c.isalnum() or c in "._-" else "-" for c in name) or "model")
    return stem + ("-quick" if quick else "") + ".json"


def write_json(path: Path, data, indent: int = 2) -> Path:
    """Writes `data` as JSON to `path`, making its folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
    return path


def write_result(path, **fields) -> dict:
    """Writes a result JSON: the command that ran it, this machine (machine_info), the time it
    finished, then `fields`. Returns the machine info, for the summary line."""
    info = machine_info()
    write_json(path, {"command": " ".join(sys.argv), "machine": info,
                      "finished": time.strftime("%Y-%m-%d %H:%M:%S"), **fields}, indent=1)
    return info


def finish_rounds(console, args, ratios: dict, load_before, **fields) -> None:
    """The end of a benchmark of rounds: prints each of `ratios` (spread() over the rounds)
    and the 1-minute load average before -> after, writes the result JSON to args.output
    (write_result: the arguments, `fields`, the ratios, both load averages and a note that
    the machine is shared) and prints the machine summary and where it wrote."""
    for key, value in ratios.items():
        console.print(f"{key}: {value['median']:.3f} (min {value['min']:.3f}, "
                      f"max {value['max']:.3f})")
    load_after = os.getloadavg()
    console.print(f"load average (1 min) before -> after: {load_before[0]:.1f} -> "
                  f"{load_after[0]:.1f}")
    info = write_result(args.output, args=vars(args) | {"output": str(args.output)}, **fields,
                        ratios=ratios, loadavg_before=load_before, loadavg_after=load_after,
                        noise="2-core VM shared with other agents' jobs: figures drift")
    console.print(machine_summary(info))
    console.print(f"wrote {args.output}")
