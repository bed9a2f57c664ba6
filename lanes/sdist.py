"""Releases the package index has only as a source archive (sdist): fetched, built with their own
build, installed like any wheel.

    python lanes/sdist.py fetch vllm-ascend 0.30.0rc2            # -> path of the cached .tar.gz
    python lanes/sdist.py wheel vllm-ascend 0.30.0rc2            # -> path of the cached built wheel
    python lanes/sdist.py install vllm-ascend 0.30.0rc2 --python .nox/lane-vllm-0.30/bin/python
    python lanes/sdist.py pair vllm-ascend 0.30.0rc2              # the vLLM its versioning policy names
    python lanes/sdist.py list vllm-ascend                         # versions that have an sdist

- fetch: the archive, downloaded with pip's own index client and pip's configuration (index,
  extra indexes, find-links, certificates: whatever ``pip install`` on this machine would use),
  into a cache outside the checkout (``$NPU_SHIM_SDIST_CACHE``, default
  ``~/.cache/npu-shim/sdists``), so a fresh clone downloads each archive once per machine.
- wheel: the archive built by its own build backend, ``uv build --wheel --no-build-isolation``,
  in a throwaway venv holding only lanes/_sdist-build.txt (pinned), with the environment
  BUILD_ENV names. vllm-ascend's build compiles Ascend C++ ops with CMake and the Ascend
  toolkit only when COMPILE_CUSTOM_KERNELS is on; with it off the build needs setuptools,
  setuptools-scm and wheel, no torch, torch_npu, CMake or toolkit, and gives the release's
  pure-Python wheel (``py3-none-any``) with upstream's own metadata, entry points and generated
  ``_build_info.py``. The compiled extension modules (``vllm_ascend/*.so``) are absent, as on a
  machine whose build skipped them; the modules the lanes test import none of them. The wheel
  is cached under ``<cache>/built-<rule key>/``, the key a digest of the rule that made it (build
  command, BUILD_ENV, the build pins, the build Python and uv versions), so a changed rule
  never serves a wheel the old one made.
- install: that wheel into another interpreter's environment (``uv pip install --no-deps``);
  the lanes instead list the wheel's path among their pins (noxfile.py lane_requirements).

Lanes run in parallel: one lane downloads or builds a given entry while the others wait for it,
and every writer has its own partial file (``_cachefile.py``). Runs with the interpreter that
runs nox (it has pip and uv); the target venv needs neither.
"""
import argparse
import functools
import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _cachefile, also when loaded by path
from _cachefile import one_maker, unique_partial  # noqa: E402
from _sources import uv_source_args  # noqa: E402


def cache_dir():
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "npu-shim", "sdists")
    return os.environ.get("NPU_SHIM_SDIST_CACHE") or default


def with_index(action):
    """``action(session, sdists)`` inside pip's command context, where ``sdists(name)`` is
    {version: link} of that project's source archives, found with pip's own index client
    configured exactly as ``pip download`` would be (pip.conf, PIP_* variables)."""
    from pip._internal.commands.download import DownloadCommand
    from pip._internal.index.collector import LinkCollector
    from pip._internal.index.package_finder import PackageFinder
    from pip._internal.models.selection_prefs import SelectionPreferences

    cmd = DownloadCommand("download", "fetch an sdist")
    with cmd.main_context():
        options, _ = cmd.parse_args([])
        session = cmd.get_default_session(options)
        collector = LinkCollector.create(session, options=options)
        prefs = SelectionPreferences(allow_yanked=False, allow_all_prereleases=True)
        finder = PackageFinder.create(link_collector=collector, selection_prefs=prefs)

        def sdists(name):
            found = {}
            for cand in finder.find_all_candidates(name):
                if cand.link.filename.endswith((".tar.gz", ".zip")):
                    found.setdefault(str(cand.version), cand.link)
            return found

        return action(session, sdists)


def _normal(name):
    return re.sub(r"[-_.]+", "_", name).lower()


def _cached(name, version):
    directory = cache_dir()
    prefix = "%s-%s." % (_normal(name), version)
    if os.path.isdir(directory):
        for entry in sorted(os.listdir(directory)):
            if entry.lower().startswith(prefix) and entry.endswith((".tar.gz", ".zip")):
                return os.path.join(directory, entry)
    return None


def fetch(name, version):
    """Path of the cached archive of ``name==version``, downloaded if missing (one lane
    downloads while the others needing it wait: _cachefile.one_maker)."""
    cached = _cached(name, version)
    if cached:
        return cached
    with one_maker(os.path.join(cache_dir(), "%s-%s" % (_normal(name), version))):
        return _cached(name, version) or _download(name, version)


def _download(name, version):
    directory = cache_dir()

    def download(session, sdists):
        found = sdists(name)
        link = found.get(version)
        if link is None:
            raise SystemExit("no sdist of %s %s on the index (sdists: %s)" % (name, version, ", ".join(found) or "none"))
        response = session.get(link.url_without_fragment, timeout=300)
        response.raise_for_status()
        return link, response

    link, response = with_index(download)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, link.filename)
    partial = unique_partial(path)
    with open(partial, "wb") as handle:
        handle.write(response.content)
    if link.hash_name and link.hash:
        digest = hashlib.new(link.hash_name, response.content).hexdigest()
        if digest != link.hash:
            os.remove(partial)
            raise SystemExit("%s: %s mismatch (%s != %s)" % (link.filename, link.hash_name, digest, link.hash))
    os.replace(partial, path)
    return path


def _members(archive):
    """{path inside the source tree (first component dropped): TarInfo} of regular files."""
    members = {}
    for info in archive.getmembers():
        parts = info.name.split("/", 1)
        if info.isfile() and len(parts) == 2:
            members[parts[1]] = info
    return members


def _read(archive, members, path):
    info = members.get(path)
    return None if info is None else archive.extractfile(info).read()


# Set for the build of each distribution, over the caller's environment. vllm-ascend:
# COMPILE_CUSTOM_KERNELS=0 leaves out its CMake extension (the Ascend C++ ops, which need the
# toolkit); SOC_VERSION names the chip, which its setup.py otherwise asks npu-smi for, and which
# only decides the __device_type__ written into _build_info.py: ascend910b1 is an Atlas A2, and
# 'A2' is what the published wheels (0.23.0 .. 0.26.0rc1) carry.
BUILD_ENV = {
    "vllm-ascend": {"COMPILE_CUSTOM_KERNELS": "0", "SOC_VERSION": "ascend910b1"},
}
BUILD_REQUIREMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sdist-build.txt")
UV = (sys.executable, "-m", "uv")
# Part of the rule key, so it is kept as a template (the placeholders differ per build).
BUILD_COMMAND = ("build", "--wheel", "--no-build-isolation", "--python", "{python}", "--out-dir", "{out}", "{sdist}")


@functools.lru_cache(maxsize=None)
def rule_key():
    """A digest of everything that decides what a build makes (the sdist itself is named by the
    entry's file name, its download checked against the index's hash)."""
    with open(BUILD_REQUIREMENTS, "rb") as handle:
        pins = handle.read()
    uv_version = subprocess.run([*UV, "--version"], check=True, capture_output=True, text=True).stdout.strip()
    rule = repr((BUILD_COMMAND, sorted((k, sorted(v.items())) for k, v in BUILD_ENV.items()), pins,
                 "python %d.%d" % sys.version_info[:2], uv_version))
    return "rule-" + hashlib.sha256(rule.encode()).hexdigest()[:12]


def built_dir():
    return os.path.join(cache_dir(), "built-" + rule_key())


def _cached_wheel(name, version):
    found = sorted(glob.glob(os.path.join(built_dir(), "%s-%s-*.whl" % (_normal(name), version))))
    return found[0] if found else None


def wheel(name, version):
    """Path of the wheel built from ``name==version``'s sdist, built if missing (one maker at a
    time: _cachefile.one_maker)."""
    cached = _cached_wheel(name, version)
    if cached:
        return cached
    with one_maker(os.path.join(built_dir(), "%s-%s" % (_normal(name), version))):
        return _cached_wheel(name, version) or _build(name, version)


def _build(name, version):
    sdist = fetch(name, version)
    env = dict(os.environ, **BUILD_ENV.get(name, {}))
    env.pop("VIRTUAL_ENV", None)  # uv must build in the build venv named by --python, not nox's
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="npu-shim-sdist-build-") as scratch:
        venv, out = os.path.join(scratch, "venv"), os.path.join(scratch, "out")
        python = os.path.join(venv, "bin", "python")
        subprocess.run([*UV, "venv", "--quiet", "--python", sys.executable, venv], check=True,
                       env=dict(env, UV_PYTHON_DOWNLOADS="never"))
        subprocess.run([*UV, "pip", "install", "--quiet", "--python", python, "--no-deps", *uv_source_args(),
                        "-r", BUILD_REQUIREMENTS], check=True, env=env)
        command = [*UV, *(part.format(python=python, sdist=sdist, out=out) for part in BUILD_COMMAND)]
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit("building %s %s from %s failed (exit %d):\n%s"
                             % (name, version, os.path.basename(sdist), proc.returncode,
                                (proc.stdout + proc.stderr)[-6000:]))
        built = glob.glob(os.path.join(out, "*.whl"))
        if len(built) != 1 or not os.path.basename(built[0]).lower().startswith("%s-%s-" % (_normal(name), version)):
            raise SystemExit("building %s %s gave %s, not one wheel of that version"
                             % (name, version, ", ".join(map(os.path.basename, built)) or "no wheel"))
        destination = os.path.join(built_dir(), os.path.basename(built[0]))
        partial = unique_partial(destination)
        shutil.copyfile(built[0], partial)
        os.replace(partial, destination)
    print("sdist.py: %s %s: built %s in %.1f s (%s)" % (name, version, os.path.basename(destination),
                                                        time.monotonic() - started, rule_key()), file=sys.stderr)
    return destination


def install(name, version, python):
    """The built wheel of ``name==version`` into ``python``'s environment."""
    path = wheel(name, version)
    subprocess.run([*UV, "pip", "install", "--quiet", "--python", python, "--no-deps", "--reinstall", path],
                   check=True, env=dict(os.environ, UV_PYTHON_DOWNLOADS="never"))
    print("%s %s: installed %s into %s" % (name, version, os.path.basename(path), python))


POLICY = "docs/source/community/versioning_policy.md"


def paired_vllm(version, path=None):
    """The vLLM version vllm-ascend ``version``'s own versioning policy names for it, or None.

    Reads the release compatibility table (``| v0.30.0rc1 | v0.30.0 | ...``) of the policy
    shipped in the sdist; a release missing from its own table (e.g. an rc2 whose docs were not
    updated) takes the pair of the newest row of the same base version."""
    path = path or fetch("vllm-ascend", version)
    with tarfile.open(path) as archive:
        text = (_read(archive, _members(archive), POLICY) or b"").decode("utf-8", "replace")
    rows = dict(re.findall(r"^\|\s*v?(\d[\w.]*)\s*\|\s*v?(\d[\w.]*)\s*\|", text, re.M))
    if version in rows:
        return rows[version]
    base = re.match(r"\d+\.\d+\.\d+", version).group(0)
    for release, vllm in rows.items():  # the table lists newest first
        if release.startswith(base):
            return vllm
    # Not in its own table (0.28.0rc1 and 0.29.0rc1 did not update it): the release's code
    # names the vLLM it was built for in vllm_version_is("<X.Y.Z>") branches.
    with tarfile.open(path) as archive:
        members = _members(archive)
        needle = ('vllm_version_is("%s")' % base).encode()
        for source, info in members.items():
            if source.startswith("vllm_ascend/") and source.endswith(".py"):
                if needle in archive.extractfile(info).read():
                    return base
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("fetch", "wheel", "install", "pair", "list"):
        p = sub.add_parser(command)
        p.add_argument("name")
        if command != "list":
            p.add_argument("version")
        if command == "install":
            p.add_argument("--python", required=True, help="interpreter of the target environment")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        print(fetch(args.name, args.version))
    elif args.command == "wheel":
        print(wheel(args.name, args.version))
    elif args.command == "install":
        install(args.name, args.version, args.python)
    elif args.command == "pair":
        pair = paired_vllm(args.version)
        if pair is None:
            print("%s %s: its versioning policy names no vLLM" % (args.name, args.version), file=sys.stderr)
            return 1
        print(pair)
    else:
        print("\n".join(with_index(lambda session, sdists: sdists(args.name))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
