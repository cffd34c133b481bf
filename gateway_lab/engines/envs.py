"""Cached engine environments outside the checkout, one per engine release:
`$GATEWAY_ENGINES_HOME` (default `~/.cache/inference-gateway/engines`)/`<engine>-<version>`.

An environment counts as installed when its `READY.json` exists: it is written last, after the recipe's import
check passed, so an interrupted install is redone from scratch (it is built under `<name>.partial` and renamed).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from gateway_lab.engines.recipes import Recipe

HERE = Path(__file__).resolve().parent


def home() -> Path:
    return Path(os.environ.get("GATEWAY_ENGINES_HOME") or Path.home() / ".cache" / "inference-gateway" / "engines")


@dataclass(frozen=True)
class EngineEnv:
    recipe: Recipe
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    @property
    def stub_dir(self) -> str | None:
        return str(self.path / "cuda-stub") if self.recipe.cuda_stub else None

    @property
    def ready(self) -> bool:
        return (self.path / "READY.json").is_file()

    def info(self) -> dict[str, object]:
        try:
            out: dict[str, object] = json.loads((self.path / "READY.json").read_text())
            return out
        except (OSError, ValueError):
            return {}


def env_for(recipe: Recipe) -> EngineEnv:
    return EngineEnv(recipe, home() / f"{recipe.engine}-{recipe.version}")


class InstallError(RuntimeError):
    pass


def _run(argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    with log.open("a") as f:
        f.write(f"$ {' '.join(argv)}\n")
        f.flush()
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, env=env, check=False)
    if r.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise InstallError(f"{argv[0]} {argv[1] if len(argv) > 1 else ''} failed ({r.returncode}); log {log}:\n"
                           + "\n".join(tail))


def install(recipe: Recipe, force: bool = False, say: object = print) -> EngineEnv:
    """Installs the recipe's environment unless it is already there; returns it. Times go into READY.json."""
    target = env_for(recipe)
    if target.ready and not force:
        return target
    t0 = time.monotonic()
    partial = target.path.with_name(target.path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    log = partial.parent / f"{target.path.name}.install.log"
    log.write_text("")
    _say = say if callable(say) else print
    _say(f"installing {recipe.engine}=={recipe.version} into {target.path} (log {log})")
    _run([sys.executable, "-m", "venv", str(partial)], log)
    pip = [str(partial / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as cons:
        cons.write("\n".join(r for r in recipe.requirements if r.startswith("torch==")) + "\n")
    try:
        _run([*pip, "-c", cons.name, *recipe.requirements], log)
        if recipe.no_deps:
            _run([*pip, "--no-deps", *recipe.no_deps], log)
    finally:
        os.unlink(cons.name)
    site = Path(subprocess.run([str(partial / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    if recipe.kernel:
        _python_files_of(recipe.kernel, site, partial, log)
    for name in recipe.standins:
        src = HERE / "standins" / name
        if src.is_dir():
            shutil.copytree(src, site / name, dirs_exist_ok=True)
        else:
            shutil.copy2(src, site / name)
    if recipe.uninstall:
        _run([str(partial / "bin" / "python"), "-m", "pip", "uninstall", "-y", *recipe.uninstall], log)
    if recipe.cuda_stub:
        build_cuda_stub(partial / "cuda-stub", log)
    t_install = time.monotonic() - t0
    _run([str(partial / "bin" / "python"), "-c", recipe.import_check], log,
         env=_check_env(recipe, partial))
    # the environment's scripts name their venv's path: rename, then rewrite the one line that matters to us
    shutil.rmtree(target.path, ignore_errors=True)
    partial.rename(target.path)
    for cfg in [target.path / "pyvenv.cfg"]:
        cfg.write_text(cfg.read_text().replace(str(partial), str(target.path)))
    info = {"engine": recipe.engine, "version": recipe.version, "install_s": round(t_install, 1),
            "import_check_s": round(time.monotonic() - t0 - t_install, 1), "disk_mb": _disk_mb(target.path),
            "installed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    (target.path / "READY.json").write_text(json.dumps(info, indent=2) + "\n")
    _say(f"installed {recipe.engine}=={recipe.version}: {info}")
    return target


def _check_env(recipe: Recipe, path: Path) -> dict[str, str]:
    env = dict(os.environ)
    if recipe.engine == "sglang":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    else:
        env["VLLM_TARGET_DEVICE"] = "cpu"
    if recipe.cuda_stub:
        env["LD_LIBRARY_PATH"] = str(path / "cuda-stub")
    return env


def _python_files_of(requirement: str, site: Path, venv: Path, log: Path) -> None:
    """The distribution's Python files and metadata, without its compiled libraries (CUDA builds that cannot load
    without a GPU; the CPU path never calls them)."""
    with tempfile.TemporaryDirectory() as d:
        _run([str(venv / "bin" / "python"), "-m", "pip", "download", "--no-deps", "-d", d, requirement], log)
        wheels = list(Path(d).glob("*.whl"))
        if not wheels:
            raise InstallError(f"pip download {requirement} gave no wheel")
        with zipfile.ZipFile(wheels[0]) as z:
            for name in z.namelist():
                if name.endswith(".so") or name.endswith("/RECORD"):
                    continue
                z.extract(name, site)


def build_cuda_stub(out: Path, log: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise InstallError("no C compiler (cc) to build the CUDA stub libcuda.so.1")
    _run([cc, "-shared", "-fPIC", "-O2", "-o", str(out / "libcuda.so.1"), str(HERE / "cuda_stub.c")], log)
    link = out / "libcuda.so"
    if not link.exists():
        link.symlink_to("libcuda.so.1")


def _disk_mb(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            p = os.path.join(root, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
    return total // (1 << 20)

