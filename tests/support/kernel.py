"""The probe every real-kernel test and fixture runs first: skips with the reason when this
machine cannot load BPF programs or make network namespaces."""

from __future__ import annotations

import os
import shutil

import pytest

from kpr.node import host


def skip_unless_kernel_ready() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: loads BPF programs and makes network namespaces")
    try:
        host.require_bcc()
        host.require_kernel_headers()
        host.cgroup2_root()
    except host.SetupError as err:
        pytest.skip(str(err))
    if shutil.which("ip") is None:
        pytest.skip("needs iproute2's `ip` for network namespaces")
