"""A PATH without some programs, and the rule dumpers the conflict check runs."""

from __future__ import annotations

import os


def path_without(tmp_path, *tools: str) -> str:
    """A PATH with every program of this one except `tools`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for name in os.listdir(directory):
            link = bin_dir / name
            if name not in tools and not link.exists():
                link.symlink_to(os.path.join(directory, name))
    return str(bin_dir)


IPTABLES_AND_NFT = (
    "iptables-save",
    "ip6tables-save",
    "iptables-legacy-save",
    "ip6tables-legacy-save",
    "nft",
)
