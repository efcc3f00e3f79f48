"""The pinned GPU stack (constraints-gpu.txt, pyproject's `gpu` extra, docker/Dockerfile) agrees
with itself and with the CPU environment's pins; offline. The slow test asks pip's resolver, on
PyPI, whether the pins install together for the image's Python (docs/install.md, "GPU clusters").

What none of this proves: that TE, flash-attn and apex compile (the Dockerfile does that, with
the CUDA toolkit) and that the CUDA kernels run (benchmarks/gpu_check.py on a GPU)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
GPU_CONSTRAINTS = ROOT / "constraints-gpu.txt"
CPU_CONSTRAINTS = ROOT / "constraints-cpu.txt"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PYPROJECT = ROOT / "pyproject.toml"

# transformer-engine-torch is an sdist whose build needs torch and nvcc, so the resolver check
# cannot ask pip for it: it resolves its declared requirements instead, read from the sdist's
# PKG-INFO (its setup.py adds transformer_engine_cu{major of torch.version.cuda}==<version>).
TE_TORCH_REQUIRES = {
    "2.17.1": ["torch>=2.1", "einops", "onnxscript", "onnx", "packaging", "pydantic", "nvdlfw-inspect"],
}
# flash-attn is an sdist too (its setup.py imports torch and compiles with nvcc): its setup.py's
# install_requires, per pinned version.
FLASH_ATTN_REQUIRES = {
    "2.8.3": ["torch", "einops"],
}
# The flash-attn 2.x versions each pinned Transformer-Engine uses, both ends included: its
# dot_product_attention/utils.py, FlashAttentionUtils.version_required and max_version (the
# trainer's own copy is gpu_flags.TE_FLASH_ATTN_RANGE; its refusals name gpu_flags.FLASH_ATTN_PIN).
TE_ACCEPTS_FLASH_ATTN = {
    "2.17.1": ("2.1.1", "2.8.3"),
}
# The architectures flash-attn's setup.py compiles for (FLASH_ATTN_CUDA_ARCHS; it ignores others).
FLASH_ATTN_KNOWN_ARCHS = {"80", "90", "100", "120"}
IMAGE_PYTHON = "3.12"  # Ubuntu 24.04's, the Dockerfile's venv
RESOLVER_PIP = "pip==26.3"  # fast-deps, and a dry run that stops before downloading wheels


def _pins(path: Path) -> dict[str, str]:
    """{canonical name: version} of a constraints file; every line must be `name==version`."""
    pins: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==" and not req.extras and req.marker is None, \
            f"{path.name}: {line!r} is not a plain name==version pin"
        name = canonicalize_name(req.name)
        assert name not in pins, f"{path.name}: {name} pinned twice"
        pins[name] = specs[0].version
    return pins


def _torch_cuda() -> str:
    """The CUDA major.minor of the pinned torch wheel, declared in constraints-gpu.txt."""
    found = re.findall(r"^# torch CUDA: (\d+\.\d+)\s*$", GPU_CONSTRAINTS.read_text(), re.M)
    assert len(found) == 1, "constraints-gpu.txt must declare '# torch CUDA: <major>.<minor>' once"
    return found[0]


def _gpu_extra() -> list[Requirement]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    return [Requirement(r) for r in project["optional-dependencies"]["gpu"]]


def _dependencies() -> list[Requirement]:
    return [Requirement(r) for r in tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]]


def _dockerfile() -> str:
    """The Dockerfile with its line continuations joined (one instruction per line)."""
    return DOCKERFILE.read_text().replace("\\\n", " ")


def test_gpu_constraints_pin_one_version_of_each_stack_package():
    pins = _pins(GPU_CONSTRAINTS)
    for name in ("torch", "vllm", "transformer-engine", "transformer-engine-torch", "megatron-core",
                 "transformers", "flash-attn"):
        assert name in pins, f"constraints-gpu.txt does not pin {name}"
    cores = [n for n in pins if re.fullmatch(r"transformer-engine-cu\d+", n)]
    assert cores == [f"transformer-engine-cu{_torch_cuda().split('.')[0]}"], \
        f"TE's core library must be the one of torch's CUDA major: {cores}"
    te = {n: v for n, v in pins.items() if n.startswith("transformer-engine")}
    assert len(set(te.values())) == 1, f"TE's packages at different versions: {te}"
    assert pins["transformer-engine-torch"] in TE_TORCH_REQUIRES, \
        "new TE pin: copy its transformer-engine-torch sdist's Requires-Dist into TE_TORCH_REQUIRES"
    assert pins["flash-attn"] in FLASH_ATTN_REQUIRES, \
        "new flash-attn pin: copy its setup.py's install_requires into FLASH_ATTN_REQUIRES"


def test_flash_attn_pin_is_one_the_pinned_te_uses_and_the_trainers():
    """TE ignores a flash-attn outside its range (a .post release is above 2.8.3), and the
    trainer then refuses an A100 run: the pin must be inside it, a plain release, and the
    version the trainer's refusals tell users to install."""
    from megatron_dgpo.runtime import gpu_flags

    pins = _pins(GPU_CONSTRAINTS)
    te = pins["transformer-engine"]
    assert te in TE_ACCEPTS_FLASH_ATTN, \
        "new TE pin: read its FlashAttentionUtils range into TE_ACCEPTS_FLASH_ATTN"
    low, high = TE_ACCEPTS_FLASH_ATTN[te]
    flash = Version(pins["flash-attn"])
    assert flash.post is None and flash.dev is None and flash.local is None and not flash.is_prerelease, \
        f"flash-attn {flash}: TE compares the public version, and 2.8.3.post1 > 2.8.3"
    assert Version(low) <= flash <= Version(high), f"TE {te} ignores flash-attn {flash} ({low} to {high})"
    assert Version(gpu_flags.TE_FLASH_ATTN_BLACKWELL_MIN) <= flash, "TE ignores it on sm100"
    assert gpu_flags.TE_FLASH_ATTN_RANGE == (low, high)
    assert gpu_flags.FLASH_ATTN_PIN == pins["flash-attn"]


def test_refusals_point_at_headings_of_the_install_page():
    """The trainer's GPU refusals send users to a section of docs/install.md by its name
    ("docs/install.md, 'Attention backends'"): that section must exist, the attention one under
    exactly that heading."""
    from megatron_dgpo.runtime import gpu_flags

    install = ROOT / "docs" / "install.md"
    prose = re.sub(r"^```.*?^```", "", install.read_text(), flags=re.M | re.S)  # not bash comments
    headings = [h.strip() for h in re.findall(r"^#+ (.+)$", prose, re.M)]
    pointers = {name: getattr(gpu_flags, name) for name in dir(gpu_flags) if name.endswith("_HELP")}
    assert "ATTENTION_HELP" in pointers, sorted(pointers)
    for name, pointer in pointers.items():
        found = re.fullmatch(r"docs/install\.md, '(.+)'", pointer)
        assert found, f"gpu_flags.{name} = {pointer!r}"
        assert any(found[1] in h for h in headings), f"gpu_flags.{name}: no heading {found[1]!r}"
    assert "Attention backends" in headings


def test_megatron_core_and_transformers_as_on_cpu():
    gpu, cpu = _pins(GPU_CONSTRAINTS), _pins(CPU_CONSTRAINTS)
    assert Version(gpu["megatron-core"]).release[:2] == (0, 19), \
        "megatron-core must stay 0.19.x (megatron_dgpo/convert/_megatron_compat.py)"
    assert gpu["megatron-core"] == cpu["megatron-core"]
    assert gpu["transformers"] == cpu["transformers"]


def test_pyproject_admits_exactly_the_pinned_gpu_stack():
    pins = _pins(GPU_CONSTRAINTS)
    extra = {canonicalize_name(r.name): r for r in _gpu_extra()}
    assert set(extra) == {"vllm", "transformer-engine", "flash-attn"}, sorted(extra)
    assert extra["transformer-engine"].extras == {"pytorch"}
    for name, req in extra.items():
        admitted = [v for v in _candidates(pins[name]) if req.specifier.contains(v, prereleases=True)]
        assert admitted == [pins[name]], f"gpu extra {req} admits {admitted}, pinned {pins[name]}"
    mcore = next(r for r in _dependencies() if canonicalize_name(r.name) == "megatron-core")
    for version, ok in (("0.19.0", True), ("0.19.2", True), ("0.19.9", True), ("0.16.1", False),
                        ("0.20.0rc0", False), ("0.20.0", False), ("0.18.2", False)):
        assert mcore.specifier.contains(version, prereleases=True) is ok, (str(mcore), version)
    assert mcore.specifier.contains(pins["megatron-core"])


def _candidates(pinned: str) -> list[str]:
    """The pinned version and its neighbours: the extra must admit the first only."""
    v = Version(pinned)
    major, minor, micro = (list(v.release) + [0, 0])[:3]
    return [pinned, f"{major}.{minor}.{micro + 1}", f"{major}.{minor + 1}.0", f"{major + 1}.0.0",
            f"{major}.{minor}.{micro}.post1", f"{major}.{minor}.{micro + 1}rc1"] + \
        ([f"{major}.{minor}.{micro - 1}"] if micro else []) + ([f"{major}.{minor - 1}.0"] if minor else [])


def test_dockerfile_installs_from_the_gpu_constraints():
    text = _dockerfile()
    assert "COPY constraints-gpu.txt" in text
    installs = [line for line in text.splitlines() if re.search(r"\bpip install\b", line)]
    for line in installs:
        if "--upgrade pip" in line:
            continue
        assert "-c constraints-gpu.txt" in line, f"pip install without the GPU pins: {line.strip()}"
    pins = _pins(GPU_CONSTRAINTS)
    for name, version in re.findall(r"([A-Za-z][\w.-]*)(?:\[[\w,-]+\])?==([\w.]+)", text):
        name = canonicalize_name(name)
        if name in pins:
            assert version == pins[name], f"Dockerfile says {name}=={version}, constraints {pins[name]}"


def test_dockerfile_builds_te_and_apex_against_the_installed_torch():
    lines = _dockerfile().splitlines()
    te = [line for line in lines if re.search(r"pip install .*transformer.engine\[pytorch\]", line)]
    assert len(te) == 1 and "--no-build-isolation" in te[0], te
    apex = [line for line in lines if "github.com/NVIDIA/apex" in line]
    assert len(apex) == 1 and "--no-build-isolation" in apex[0], apex
    assert '"--build-option=--cpp_ext"' in apex[0] and '"--build-option=--cuda_ext"' in apex[0]
    assert re.search(r"^ARG APEX_COMMIT=[0-9a-f]{40}$", "\n".join(lines), re.M), "apex at a fixed commit"
    order = [next(i for i, line in enumerate(lines) if re.search(pattern, line))
             for pattern in (r"pip install .* torch vllm", r"transformer.engine\[pytorch\]",
                             r"github.com/NVIDIA/apex", r'pip install .* -e "\.\[gpu\]"')]
    assert order == sorted(order), "torch+vLLM, then TE, then apex, then the project"
    check = next(line for line in lines if "import torch, vllm, transformer_engine.pytorch" in line)
    assert "megatron.core" in check and "fused_weight_gradient_mlp_cuda" in check


def _flash_attn_jobs(tmp_path, mem_available_gib: float, *, cores: int = 64, max_jobs: str = "",
                     archs: str = "80;90;100") -> int:
    """The MAX_JOBS the Dockerfile's flash-attn step compiles with, its shell run up to the pip
    install with ``/proc/meminfo`` and ``nproc`` stood in."""
    run = next(line for line in _dockerfile().splitlines()
               if re.search(r"pip install .*\bflash-attn\b", line))
    script = run.removeprefix("RUN ").split("FLASH_ATTENTION_FORCE_BUILD=TRUE")[0]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {int(mem_available_gib * 1.05 * 2**20)} kB\n"
                       f"MemAvailable: {int(mem_available_gib * 2**20)} kB\n")
    script = script.replace("/proc/meminfo", str(meminfo))
    out = subprocess.run(["bash", "-c", f"nproc() {{ echo {cores}; }}; MAX_JOBS='{max_jobs}'; "
                          f"FLASH_ATTN_CUDA_ARCHS='{archs}'; {script}"],
                         capture_output=True, text=True, check=True).stdout
    return int(re.fullmatch(r"flash-attn: MAX_JOBS=(\d+)\n", out)[1])


def test_flash_attn_compiles_with_as_many_jobs_as_the_build_hosts_memory_holds(tmp_path):
    """Each nvcc job of flash-attn holds ~6.5 GiB per architecture (docs/install.md); the old
    default MAX_JOBS=8 wanted ~150 GiB for three, and overrode flash-attn's own memory-based
    count. By default the count follows the memory available: a 64 GB host (~58 GiB free)
    compiles 2 jobs for three architectures, 8 for one; never more than the cores, never 0.
    ``--build-arg MAX_JOBS`` still sets it."""
    assert re.search(r"^ARG MAX_JOBS=$", _dockerfile(), re.M)
    assert _flash_attn_jobs(tmp_path, 58) == 2
    assert _flash_attn_jobs(tmp_path, 58, archs="80") == 8
    assert _flash_attn_jobs(tmp_path, 1000) == 47 and _flash_attn_jobs(tmp_path, 1000, cores=16) == 16
    assert _flash_attn_jobs(tmp_path, 12) == 1
    assert _flash_attn_jobs(tmp_path, 58, max_jobs="6") == 6
    for available in (30, 58, 120, 500):  # what the count asks stays within what is there
        assert _flash_attn_jobs(tmp_path, available) * 3 * 6.5 <= max(available, 3 * 6.5)


def _import_check() -> str:
    """The Python of the Dockerfile's final import check (its `python -c "..."`)."""
    line = next(line for line in _dockerfile().splitlines()
                if "import torch, vllm, transformer_engine.pytorch" in line)
    return re.search(r'python -c "(.*?)"\s*&&', line)[1].strip()


def test_dockerfile_builds_flash_attn_against_the_installed_torch_and_checks_te_counts_it():
    """flash-attn is compiled in the image (no prebuilt wheel for torch 2.13 / CUDA 13, and a
    .post wheel is one TE ignores): from the pins, without isolation, after torch and before
    the project; the import check asserts TE's own verdict (FlashAttentionUtils.is_installed)."""
    text = _dockerfile()
    lines = text.splitlines()
    installs = [line for line in lines if re.search(r"pip install .*\bflash[-_]attn\b", line)]
    assert len(installs) == 1, installs
    flash = installs[0]
    assert "--no-build-isolation" in flash and "-c constraints-gpu.txt" in flash, flash
    assert re.search(r"\bFLASH_ATTENTION_FORCE_BUILD=TRUE\b", flash), "must compile, never fetch a wheel"
    assert 'FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}"' in flash and "MAX_JOBS=$jobs" in flash
    assert not re.search(r"flash[-_]attn[^\s]*post|\.whl|releases/download", text, re.I), \
        "flash-attn from the constraints' sdist only, never a (.post) prebuilt wheel"
    order = [next(i for i, line in enumerate(lines) if re.search(pattern, line))
             for pattern in (r"pip install .* torch vllm", r"transformer.engine\[pytorch\]",
                             r"pip install .*\bflash-attn\b", r'pip install .* -e "\.\[gpu\]"')]
    assert order == sorted(order), "torch, TE, flash-attn, then the project"
    assert re.search(r"pip install .* torch vllm .*\bninja\b", text), \
        "ninja before the builds without isolation (torch's builder is serial without it)"

    check = _import_check()
    compile(check, "Dockerfile import check", "exec")  # a syntax error would only show in the build
    assert re.search(r"\bimport flash_attn, flash_attn_2_cuda\b", check)
    assert "dot_product_attention.backends" in check and "FlashAttentionUtils" in check
    assert re.search(r"assert fa\.is_installed and str\(fa\.version\) == flash_attn\.__version__ == "
                     r"pins\['flash-attn'\]", check)


def test_dockerfile_arch_lists_name_the_same_gpus():
    """TE, apex and flash-attn are compiled for the same GPU generations (their build args
    spell them differently), and flash-attn's only for architectures its setup.py knows."""
    text = _dockerfile()

    def arg(name: str) -> list[str]:
        found = re.search(rf'^ARG {name}="([\d.;]+)"$', text, re.M)
        assert found, f"ARG {name}=\"...\" missing"
        return found[1].split(";")

    torch_archs = [a.replace(".", "") for a in arg("TORCH_CUDA_ARCH_LIST")]
    assert torch_archs == arg("NVTE_CUDA_ARCHS") == arg("FLASH_ATTN_CUDA_ARCHS"), \
        (torch_archs, arg("NVTE_CUDA_ARCHS"), arg("FLASH_ATTN_CUDA_ARCHS"))
    assert set(arg("FLASH_ATTN_CUDA_ARCHS")) <= FLASH_ATTN_KNOWN_ARCHS
    assert "80" in arg("FLASH_ATTN_CUDA_ARCHS"), "A100: the GPU that needs flash-attn"


def test_dockerfile_base_image_cuda_is_the_torch_wheels():
    text = _dockerfile()
    arg = re.search(r"^ARG CUDA_VERSION=(\d+)\.(\d+)\.\d+$", text, re.M)
    base = re.search(r"^FROM nvidia/cuda:\$\{CUDA_VERSION\}-cudnn-devel-ubuntu(\d+\.\d+)$", text, re.M)
    assert arg and base, "expected ARG CUDA_VERSION=X.Y.Z and FROM nvidia/cuda:${CUDA_VERSION}-cudnn-devel-..."
    assert f"{arg[1]}.{arg[2]}" == _torch_cuda(), \
        f"base image CUDA {arg[1]}.{arg[2]} != the torch wheel's {_torch_cuda()} (apex needs them equal)"
    assert base[1] == "24.04", f"Ubuntu 24.04 brings the image's Python {IMAGE_PYTHON}"
    assert f"python{IMAGE_PYTHON}" in text


# --- the resolver, on PyPI ---------------------------------------------------------------------

def _resolver_requirements() -> list[str]:
    """What the image installs, as one resolver request: the project's dependencies, the gpu
    extra with transformer-engine[pytorch] replaced by its core library and transformer-engine-
    torch's declared requirements, and flash-attn by its declared requirements (sdists that
    cannot be built here)."""
    pins = _pins(GPU_CONSTRAINTS)
    cuda_major = _torch_cuda().split(".")[0]
    reqs = [str(r) for r in _dependencies()]
    for r in _gpu_extra():
        if canonicalize_name(r.name) == "transformer-engine":
            reqs.append(f"transformer-engine[core-cu{cuda_major}]{r.specifier}")
            reqs += TE_TORCH_REQUIRES[pins["transformer-engine-torch"]]
        elif canonicalize_name(r.name) == "flash-attn":
            reqs += FLASH_ATTN_REQUIRES[pins["flash-attn"]]
        else:
            reqs.append(str(r))
    return reqs


def _resolver_env() -> dict[str, str]:
    """PyPI as pip sees it by default: no pip config files (this machine's adds a local
    wheelhouse and a torch cap), no local indexes or constraints from the environment."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX",
                        "PIP_REQUIRE_VIRTUALENV", "PIP_TARGET", "PIP_USER")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _run_guarded(cmd: list[str], log: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """Run pip; kill it if it starts downloading a whole big wheel (fast-deps falling back when
    an index refuses range requests would fetch several GB of CUDA wheels)."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    big: list[str] = []

    def watch() -> None:
        seen = 0
        while proc.poll() is None:
            if log.exists():
                with open(log, errors="replace") as f:
                    f.seek(seen)
                    chunk = f.read()
                seen += len(chunk.encode(errors="replace"))
                for size, unit in re.findall(r"Downloading \S+\.whl \((\d+(?:\.\d+)?) ([kMG]?B)\)", chunk):
                    if unit == "GB" or (unit == "MB" and float(size) > 50):
                        big.append(f"{size} {unit}")
                        proc.kill()
                        return
            time.sleep(0.5)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"resolver took over {timeout} s: {out[-2000:]}")
    watcher.join()
    assert not big, f"pip fell back to downloading whole wheels ({big[0]}): stopped"
    return proc.returncode, out


def _image_python() -> str | None:
    """A Python of the image's version, when there is one: environment markers are evaluated
    for the interpreter running pip (--python-version only picks wheels)."""
    candidates = [shutil.which(f"python{IMAGE_PYTHON}")]
    pyenv_root = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates += sorted(str(p) for p in pyenv_root.glob(f"versions/{IMAGE_PYTHON}*/bin/python{IMAGE_PYTHON}"))
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import sys, venv; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == IMAGE_PYTHON:
            return candidate
    return None


@pytest.mark.slow  # ~1-2 min and ~90 MB from PyPI: `make test-slow`
def test_pypi_resolver_agrees(tmp_path):
    env = _resolver_env()
    python = _image_python() or sys.executable
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    vpython = str(venv / "bin" / "python")
    boot = subprocess.run([vpython, "-m", "pip", "install", "-q", RESOLVER_PIP], env=env,
                          capture_output=True, text=True, timeout=300)
    if boot.returncode != 0:
        pytest.skip(f"cannot install {RESOLVER_PIP} from the package index: {boot.stdout[-500:]}{boot.stderr[-500:]}")

    platforms = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + ["manylinux2014_x86_64"]
    report, log = tmp_path / "report.json", tmp_path / "pip.log"
    cmd = [vpython, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--use-feature=fast-deps", "--report", str(report), "--log", str(log),
           "--only-binary=:all:", "--python-version", IMAGE_PYTHON, "--implementation", "cp",
           "--abi", "cp" + IMAGE_PYTHON.replace(".", ""),
           *[arg for p in platforms for arg in ("--platform", p)],
           "-c", str(GPU_CONSTRAINTS), *_resolver_requirements()]
    code, out = _run_guarded(cmd, log, env, timeout=600)
    assert code == 0, out[-4000:]

    resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    pins = _pins(GPU_CONSTRAINTS)
    core = f"transformer-engine-cu{_torch_cuda().split('.')[0]}"
    for name in ("torch", "vllm", "transformer-engine", core, "megatron-core", "transformers"):
        assert resolved.get(name) == pins[name], (name, resolved.get(name), pins[name])
    # The torch wheel's CUDA (its CUDA runtime package) is the one declared, hence the base image's.
    runtimes = [v for n, v in resolved.items() if re.fullmatch(r"nvidia-cuda-runtime(-cu\d+)?", n)]
    assert len(runtimes) == 1, runtimes
    runtime = Version(runtimes[0])
    assert f"{runtime.major}.{runtime.minor}" == _torch_cuda(), (runtimes[0], _torch_cuda())
