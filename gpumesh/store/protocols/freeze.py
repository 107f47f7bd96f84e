"""Freeze a release's Redis Functions library from git history, so that later releases serve it.

    python -m gpumesh.store.protocols.freeze REV [--protocol N]

checks out REV's ``gpumesh`` package (``git archive``) into a temporary directory, asks that release's own
``scripts.library()`` for the library it loads (run by this interpreter, with REV's package first on the
path and nothing of this checkout's), and writes it, byte for byte, to ``gpumesh/store/protocols/<N>.lua``.
N is REV's ``gpumesh._version.PROTOCOL``; a release from before protocol numbers needs ``--protocol``.
Run it from the repository's root when a release changes the protocol: the new release freezes the one
before it, adds it to ``FROZEN_FROM``, and deletes the copy two protocols back.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

_BUILD = (
    "import json, sys\n"
    "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"  # not this checkout's
    "sys.path.insert(0, sys.argv[1])\n"
    "from gpumesh.store import scripts\n"
    "assert scripts.__file__.startswith(sys.argv[1]), scripts.__file__\n"
    "try:\n"
    "    from gpumesh._version import PROTOCOL\n"
    "except ImportError:\n"
    "    PROTOCOL = None\n"
    "print(json.dumps([PROTOCOL, *scripts.library()]))\n"
)


def built(rev: str, repo: Path) -> tuple[int | None, str, str]:
    """(protocol or None, library name, code) as git revision ``rev`` of ``repo`` builds its library."""
    archive = subprocess.run(["git", "-C", str(repo), "archive", rev, "gpumesh"], capture_output=True, check=True)
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(tmp, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(tmp)
        out = subprocess.run(
            [sys.executable, "-P", "-c", _BUILD, tmp], capture_output=True, text=True, check=True, cwd=tmp
        )
    protocol, name, code = json.loads(out.stdout)
    return protocol, name, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rev", help="the git revision of the release to freeze (a tag or a commit)")
    parser.add_argument("--protocol", type=int, help="its protocol number, for a release from before them")
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="the git repository (default: here)")
    args = parser.parse_args()
    protocol, name, code = built(args.rev, args.repo)
    protocol = protocol if protocol is not None else args.protocol
    if protocol is None:
        parser.error(f"{args.rev} has no gpumesh._version.PROTOCOL: name its protocol with --protocol N")
    path = Path(__file__).with_name(f"{protocol}.lua")
    path.write_text(code)
    print(f"wrote {path} (library {name}, protocol {protocol}, from {args.rev})")


if __name__ == "__main__":
    main()
