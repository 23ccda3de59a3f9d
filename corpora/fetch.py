"""Fetches the archives a corpus sources file pins ([[package]]: file, url, sha256) into its
`root`, checks each against its sha256 (a mismatch is removed and refused), and unpacks it
there. An archive already present and unpacked is left as it is, so a second run does nothing.

    python corpora/fetch.py corpora/python.toml
"""

import hashlib
import pathlib
import sys
import tarfile
import tomllib
import urllib.request


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(sources):
    spec = tomllib.loads(pathlib.Path(sources).read_text())
    root = pathlib.Path(sources).parent / spec["root"]
    root.mkdir(parents=True, exist_ok=True)
    for p in spec.get("package", []):
        archive = root / p["file"]
        unpacked = root / f".{p['file']}.unpacked"
        if unpacked.exists() and archive.exists():
            continue
        if not archive.exists():
            print(f"fetching {p['url']}", file=sys.stderr)
            partial = archive.with_name(archive.name + ".partial")
            with urllib.request.urlopen(p["url"], timeout=180) as r, open(partial, "wb") as f:
                while block := r.read(1 << 20):
                    f.write(block)
            partial.rename(archive)
        got = sha256(archive)
        if got != p["sha256"]:
            archive.unlink()
            sys.exit(f"{archive} has sha256 {got}, not the pinned {p['sha256']}: removed; "
                     "run again to fetch it anew")
        with tarfile.open(archive) as t:
            t.extractall(root, filter="data")
        unpacked.touch()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
