"""Install a release that the package index has only as a source archive (sdist), unbuilt.

    python lanes/sdist.py fetch vllm-ascend 0.30.0rc2            # -> path of the cached .tar.gz
    python lanes/sdist.py install vllm-ascend 0.30.0rc2 --python .nox/lane-vllm-0.30/bin/python
    python lanes/sdist.py pair vllm-ascend 0.30.0rc2              # the vLLM its versioning policy names
    python lanes/sdist.py list vllm-ascend                         # versions that have an sdist

Why not ``pip download`` / ``pip install``: both build the sdist's metadata, and vllm-ascend's
build needs CMake and the Ascend toolkit (it compiles Ascend C++ ops). The lanes test pure-Python
modules that import none of the compiled ops, so this script

- downloads the archive with pip's own index client and pip's configuration (index, extra
  indexes, find-links, certificates: whatever ``pip install`` on this machine would use), into a
  cache outside the checkout (``$NPU_SHIM_SDIST_CACHE``, default ``~/.cache/npu-shim/sdists``),
  so a fresh clone downloads each archive once per machine;
- copies the sdist's own top-level Python package(s) (``<name>.egg-info/top_level.txt``),
  unmodified, into the target interpreter's site-packages, and writes a
  ``<name>-<version>.dist-info`` next to them: METADATA (the sdist's PKG-INFO, so
  ``importlib.metadata.version()`` returns the sdist's version and its Requires-Dist is
  upstream's), entry_points.txt (the sdist's egg-info entry points), top_level.txt, INSTALLER
  (``npu-shim-lanes-sdist``) and a RECORD of every file written; plus the files the build step
  generates without compiling (BUILD_FILES: vllm-ascend's ``_build_info.py``, as in the
  published wheels). Nothing is compiled: the
  compiled extension modules (``vllm_ascend/*.so``) are simply absent, as on a machine
  whose build skipped them.

Runs with the interpreter that runs nox (it has pip); the target venv needs no pip.
"""
import argparse
import base64
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _cachefile, also when loaded by path
from _cachefile import one_maker, unique_partial  # noqa: E402


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


def _egg_info(members):
    for path in members:
        if path.count("/") == 1 and path.split("/")[0].endswith(".egg-info") and path.endswith("/PKG-INFO"):
            return path.split("/")[0]
    return None


def _record_line(relpath, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (relpath, digest, len(data))


def install(name, version, python):
    """Copy the sdist's Python package(s) into ``python``'s site-packages with a dist-info."""
    purelib = subprocess.check_output(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], text=True
    ).strip()
    path = fetch(name, version)
    with tarfile.open(path) as archive:
        members = _members(archive)
        pkg_info = _read(archive, members, "PKG-INFO")
        if pkg_info is None:
            raise SystemExit("%s: no PKG-INFO at the top of the archive" % path)
        meta_version = re.search(rb"^Version: *(\S+)", pkg_info, re.M).group(1).decode()
        if meta_version != version:
            raise SystemExit("%s: PKG-INFO says version %s, not %s" % (path, meta_version, version))
        egg = _egg_info(members)
        top_level = (_read(archive, members, egg + "/top_level.txt") if egg else None) or _normal(name).encode()
        packages = [line.strip() for line in top_level.decode().splitlines() if line.strip()]
        entry_points = _read(archive, members, egg + "/entry_points.txt") if egg else None

        dist_info = "%s-%s.dist-info" % (_normal(name), version)
        for old in os.listdir(purelib):  # another version of the same distribution
            if old.lower().startswith(_normal(name) + "-") and old.endswith(".dist-info"):
                _uninstall(purelib, old)
        for package in packages:
            shutil.rmtree(os.path.join(purelib, package), ignore_errors=True)
        record = []
        for source in sorted(members):
            if source.split("/")[0] not in packages:
                continue
            data = archive.extractfile(members[source]).read()
            target = os.path.join(purelib, source)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(data)
            record.append(_record_line(source, data))
    for source, data in BUILD_FILES.get(name, {}).items():
        if source.split("/")[0] in packages and not os.path.exists(os.path.join(purelib, source)):
            with open(os.path.join(purelib, source), "wb") as handle:
                handle.write(data)
            record.append(_record_line(source, data))
    os.makedirs(os.path.join(purelib, dist_info), exist_ok=True)
    files = {
        "METADATA": pkg_info,
        "INSTALLER": b"npu-shim-lanes-sdist\n",
        "top_level.txt": ("\n".join(packages) + "\n").encode(),
    }
    if entry_points:
        files["entry_points.txt"] = entry_points
    for filename, data in files.items():
        with open(os.path.join(purelib, dist_info, filename), "wb") as handle:
            handle.write(data)
        record.append(_record_line(dist_info + "/" + filename, data))
    record.append(dist_info + "/RECORD,,")
    with open(os.path.join(purelib, dist_info, "RECORD"), "w", encoding="utf-8") as handle:
        handle.write("\n".join(record) + "\n")
    print("%s %s: %d files of %s from %s into %s (not built)"
          % (name, version, len(record) - 1, "/".join(packages), os.path.basename(path), purelib))


# Files a distribution's build step writes into the package without compiling anything, as the
# published wheels carry them. vllm-ascend's setup.py (build_py -> gen_build_info) writes
# vllm_ascend/_build_info.py; vllm_ascend.device.device_config imports it. The text is the one
# in the published wheels (0.23.0 .. 0.26.0rc1 all say A2).
BUILD_FILES = {
    "vllm-ascend": {"vllm_ascend/_build_info.py": b"# Auto-generated file\n__device_type__ = 'A2'\n"},
}


def _uninstall(purelib, dist_info):
    record = os.path.join(purelib, dist_info, "RECORD")
    if os.path.exists(record):
        with open(record, encoding="utf-8") as handle:
            for line in handle:
                target = os.path.join(purelib, line.split(",")[0])
                if line.strip() and os.path.isfile(target):
                    os.remove(target)
    shutil.rmtree(os.path.join(purelib, dist_info), ignore_errors=True)


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
    for command in ("fetch", "install", "pair", "list"):
        p = sub.add_parser(command)
        p.add_argument("name")
        if command != "list":
            p.add_argument("version")
        if command == "install":
            p.add_argument("--python", required=True, help="interpreter of the target environment")
    args = parser.parse_args(argv)
    if args.command == "fetch":
        print(fetch(args.name, args.version))
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
