"""The training corpus: the Python standard library's `.py` sources, present on every install.

File list: every `*.py` under `sysconfig.get_paths()["stdlib"]`, sorted by relative path,
test suites included (three times the code of the library alone: a 3.8M-parameter model
overfits the ~10 MB without them within minutes), skipping `site-packages` / `dist-packages`,
`__pycache__`, and files holding a NUL byte; kept in order until `max_bytes` is reached (sizes
from `stat`, so the list is known before a byte is read). Split: a file is held out when the
first 4 bytes of sha1(relative path) read as a big-endian integer fall below
`heldout_frac * 2**32` -- stable across machines and Python versions, independent of the cap.

Tokens are bytes. Documents are joined by DOC_SEP = 0 (NUL), a byte no kept file contains,
so the model learns a document boundary without a special token.

The stdlib differs between Python versions and installations, so the corpus of a GPU host and
of a CI machine differ; the held-out *property* the tests check (loss falls with depth) holds on
either. `root` builds from another stdlib tree instead (`tinyloop train --corpus-root DIR`), e.g.
a CI machine's sources, test suites included, unpacked on a GPU host whose Python ships none;
a `PYTHON_VERSION` file at the top of such a tree names its version in the corpus info.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DOC_SEP = 0
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
DEFAULT_MAX_BYTES = 40_000_000
DEFAULT_HELDOUT_FRAC = 0.02
INFO_VERSION = 2   # part of the cache signature: a cache written with fewer info fields is rebuilt


def stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_python(root: Path | None = None) -> str:
    """The Python version of the stdlib at `root`: this interpreter's for the default tree; for
    another, the first line of `root/PYTHON_VERSION` when present, else "unknown"."""
    if root is None or Path(root).resolve() == stdlib_dir().resolve():
        return sys.version.split()[0]
    marker = Path(root) / "PYTHON_VERSION"
    text = marker.read_text().strip() if marker.is_file() else ""
    return text.splitlines()[0].strip() if text else "unknown"


def is_test_file(rel_path: str) -> bool:
    """True for a file inside a test suite (a `test` or `tests` folder)."""
    return any(part in ("test", "tests") for part in rel_path.split("/")[:-1])


def is_heldout(rel_path: str, heldout_frac: float = DEFAULT_HELDOUT_FRAC) -> bool:
    h = int.from_bytes(hashlib.sha1(rel_path.encode("utf-8")).digest()[:4], "big")
    return h < heldout_frac * 2 ** 32


def list_files(root: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES) -> list[str]:
    """Sorted relative paths (POSIX separators) of the kept sources, capped at `max_bytes`."""
    root = Path(root) if root is not None else stdlib_dir()
    return _sources(root, root, max_bytes)


def _sources(base: Path, tree: Path, max_bytes: int) -> list[str]:
    """Sorted paths (relative to `base`, POSIX) of the `.py` files under `tree`, SKIP_DIRS
    left out, the first of them kept while their sizes sum to at most max_bytes."""
    rels = []
    for dirpath, dirnames, filenames in os.walk(tree):
        dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
        rels += [Path(dirpath, n).relative_to(base).as_posix() for n in filenames if n.endswith(".py")]
    rels.sort()
    kept, total = [], 0
    for rel in rels:
        size = (base / rel).stat().st_size
        if total + size > max_bytes:
            break
        kept.append(rel)
        total += size
    return kept


def _read_docs(root: Path, rels: list[str]) -> list[tuple[str, bytes]]:
    docs = []
    for rel in rels:
        data = (root / rel).read_bytes()
        if data and bytes([DOC_SEP]) not in data:
            docs.append((rel, data))
    return docs


def _join(docs: list[bytes]) -> np.ndarray:
    sep = bytes([DOC_SEP])
    return np.frombuffer(sep.join(docs) + sep, dtype=np.uint8).copy()


@dataclass
class Corpus:
    train: np.ndarray        # uint8 bytes, documents joined by DOC_SEP
    heldout: np.ndarray      # uint8
    info: dict               # provenance: python version, file counts, bytes, signature

    @property
    def heldout_files(self) -> list[str]:
        return self.info["heldout_files"]


def heldout_docs(root: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                 heldout_frac: float = DEFAULT_HELDOUT_FRAC) -> list[tuple[str, bytes]]:
    """The held-out documents only (reads no training file): what the CI test evaluates on."""
    root = Path(root) if root is not None else stdlib_dir()
    rels = [r for r in list_files(root, max_bytes) if is_heldout(r, heldout_frac)]
    return _read_docs(root, rels)


def heldout_bytes(root: Path | None = None, max_bytes: int = DEFAULT_MAX_BYTES,
                  heldout_frac: float = DEFAULT_HELDOUT_FRAC) -> np.ndarray:
    return _join([d for _, d in heldout_docs(root, max_bytes, heldout_frac)])


def build(cache_dir: str | os.PathLike | None = None, root: Path | None = None,
          max_bytes: int = DEFAULT_MAX_BYTES, heldout_frac: float = DEFAULT_HELDOUT_FRAC,
          verbose: bool = False) -> Corpus:
    """Build (or load from `cache_dir`) the byte corpus of the stdlib at `root` (default: this
    interpreter's)."""
    given = root is not None
    root = Path(root) if given else stdlib_dir()
    rels = list_files(root, max_bytes)
    sig_src = json.dumps([INFO_VERSION, str(root), max_bytes, heldout_frac, DOC_SEP,
                          [(r, (root / r).stat().st_size) for r in rels]])
    sig = hashlib.sha1(sig_src.encode()).hexdigest()[:12]
    paths = None
    if cache_dir is not None:
        cache = Path(cache_dir)
        paths = {k: cache / f"stdlib-{sig}-{k}" for k in ("train.npy", "heldout.npy", "info.json")}
        if all(p.exists() for p in paths.values()):
            return Corpus(np.load(paths["train.npy"]), np.load(paths["heldout.npy"]),
                          json.loads(paths["info.json"].read_text()))
    docs = _read_docs(root, rels)
    train_docs = [d for r, d in docs if not is_heldout(r, heldout_frac)]
    held = [(r, d) for r, d in docs if is_heldout(r, heldout_frac)]
    train, heldout = _join(train_docs), _join([d for _, d in held])
    info = {"source": "python stdlib .py sources", "python": source_python(root if given else None),
            "stdlib": str(root), "corpus_root": str(root) if given else None, "signature": sig,
            "max_bytes": max_bytes, "heldout_frac": heldout_frac, "doc_sep": DOC_SEP, "n_files": len(docs),
            "n_test_files": sum(is_test_file(r) for r, _ in docs),
            "n_train_files": len(train_docs), "n_heldout_files": len(held),
            "train_bytes": int(train.size), "heldout_bytes": int(heldout.size),
            "heldout_files": [r for r, _ in held]}
    if paths is not None:
        _save_cache(paths, train, heldout, info)
    if verbose:
        print(f"corpus: {root} (python {info['python']}): {info['n_train_files']} train files ({train.size / 1e6:.1f} MB), "
              f"{info['n_heldout_files']} held out ({heldout.size / 1e6:.2f} MB), {info['n_test_files']} in test suites")
    return Corpus(train, heldout, info)


# -- packages: the sources of installed packages beside the stdlib, held out by whole package --

def site_packages_dir() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def package_files(site: Path, package: str, max_bytes: int) -> list[str]:
    """Sorted paths (relative to `site`, POSIX) of package's `.py` files, capped at max_bytes;
    a package that is not installed under `site` is a ValueError naming it."""
    root = site / package
    if not root.is_dir():
        raise ValueError(f"package {package!r} is not installed under {site} (no folder {root})")
    return _sources(site, root, max_bytes)


def build_packages(packages: list[str], heldout_packages: list[str], cache_dir: str | os.PathLike | None = None,
                   site: Path | None = None, package_max_bytes: int = DEFAULT_MAX_BYTES,
                   stdlib_max_bytes: int = DEFAULT_MAX_BYTES, verbose: bool = False) -> Corpus:
    """The stdlib's sources (all training) and those of `packages` (training) and
    `heldout_packages` (held out, whole: a held-out package's code is never seen in training, so
    the held-out loss measures code the model has not memorised), each package capped at
    package_max_bytes. Documents are named "stdlib/<path>" and "<site path>"."""
    overlap = sorted(set(packages) & set(heldout_packages))
    if overlap:
        raise ValueError(f"packages both trained on and held out: {overlap}")
    if not heldout_packages:
        raise ValueError("held-out packages: at least one is needed")
    site = Path(site) if site is not None else site_packages_dir()
    std = stdlib_dir()
    std_rels = list_files(std, stdlib_max_bytes) if stdlib_max_bytes > 0 else []
    per_pkg = {p: package_files(site, p, package_max_bytes) for p in [*packages, *heldout_packages]}
    sig_src = json.dumps([INFO_VERSION, "packages", str(site), str(std), DOC_SEP, stdlib_max_bytes,
                          package_max_bytes, sorted(heldout_packages),
                          [(r, (std / r).stat().st_size) for r in std_rels],
                          {p: [(r, (site / r).stat().st_size) for r in rels] for p, rels in per_pkg.items()}])
    sig = hashlib.sha1(sig_src.encode()).hexdigest()[:12]
    paths = None
    if cache_dir is not None:
        cache = Path(cache_dir)
        paths = {k: cache / f"packages-{sig}-{k}" for k in ("train.npy", "heldout.npy", "info.json")}
        if all(p.exists() for p in paths.values()):
            return Corpus(np.load(paths["train.npy"]), np.load(paths["heldout.npy"]),
                          json.loads(paths["info.json"].read_text()))
    std_docs = [(f"stdlib/{r}", d) for r, d in _read_docs(std, std_rels)]
    docs = {p: _read_docs(site, rels) for p, rels in per_pkg.items()}
    train_docs = std_docs + [doc for p in packages for doc in docs[p]]
    held = [doc for p in heldout_packages for doc in docs[p]]
    train, heldout = _join([d for _, d in train_docs]), _join([d for _, d in held])
    info = {"source": "python sources: the stdlib and installed packages, held out by package",
            "python": sys.version.split()[0], "stdlib": str(std), "site_packages": str(site), "signature": sig,
            "split": "package", "doc_sep": DOC_SEP, "stdlib_max_bytes": stdlib_max_bytes,
            "package_max_bytes": package_max_bytes, "train_packages": list(packages),
            "heldout_packages": list(heldout_packages),
            "packages": {p: {"files": len(d), "bytes": sum(len(x) for _, x in d)} for p, d in docs.items()},
            "stdlib_files": len(std_docs), "stdlib_bytes": sum(len(x) for _, x in std_docs),
            "n_files": len(train_docs) + len(held), "n_train_files": len(train_docs), "n_heldout_files": len(held),
            "train_bytes": int(train.size), "heldout_bytes": int(heldout.size),
            "heldout_files": [r for r, _ in held]}
    if paths is not None:
        _save_cache(paths, train, heldout, info)
    if verbose:
        print(f"corpus: stdlib {info['stdlib_bytes'] / 1e6:.1f} MB + {len(packages)} packages, "
              f"{train.size / 1e6:.1f} MB training; held out {', '.join(heldout_packages)}: "
              f"{heldout.size / 1e6:.2f} MB", file=sys.stderr)
    return Corpus(train, heldout, info)


def heldout_package_bytes(heldout_packages: list[str], site: Path | None = None,
                          package_max_bytes: int = DEFAULT_MAX_BYTES) -> np.ndarray:
    """The held-out packages' documents alone (reads no training file): what eval-bpb reads."""
    site = Path(site) if site is not None else site_packages_dir()
    return _join([d for p in heldout_packages for _, d in _read_docs(site, package_files(site, p, package_max_bytes))])


def _save_cache(paths: dict, train: np.ndarray, heldout: np.ndarray, info: dict) -> None:
    paths["train.npy"].parent.mkdir(parents=True, exist_ok=True)
    np.save(paths["train.npy"], train)
    np.save(paths["heldout.npy"], heldout)
    paths["info.json"].write_text(json.dumps(info))


def installed_packages(site: Path | None = None, min_bytes: int = 0) -> dict[str, int]:
    """{top-level folder under site-packages: bytes of its .py sources} for the folders holding
    at least min_bytes, largest first (metadata and cache folders left out)."""
    site = Path(site) if site is not None else site_packages_dir()
    sizes = {}
    for d in sorted(site.iterdir()):
        if not d.is_dir() or "." in d.name or d.name in SKIP_DIRS or d.name.startswith("__"):
            continue
        n = sum((site / r).stat().st_size for r in _sources(site, d, 1 << 62))
        if n >= min_bytes:
            sizes[d.name] = n
    return dict(sorted(sizes.items(), key=lambda kv: -kv[1]))


def main(argv: list[str] | None = None) -> int:
    import argparse
    p = argparse.ArgumentParser(description="the installed packages a package corpus can use")
    p.add_argument("--list-packages", action="store_true", required=True,
                   help="print one package name per line, largest first")
    p.add_argument("--min-mb", type=float, default=0.3, help="leave out packages with fewer MB of .py")
    p.add_argument("--exclude", nargs="*", default=[], help="leave these out (e.g. the held-out ones)")
    p.add_argument("--site-packages", default=None)
    p.add_argument("--json", default=None, help="also write {package: .py bytes} of every package here")
    a = p.parse_args(argv)
    sizes = installed_packages(a.site_packages, 0)
    if a.json:
        Path(a.json).write_text(json.dumps({"site_packages": str(a.site_packages or site_packages_dir()),
                                            "py_bytes": sizes}, indent=1))
    for name, n in sizes.items():
        if n >= a.min_mb * 1e6 and name not in a.exclude:
            print(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
