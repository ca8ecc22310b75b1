"""kpr's BPF programs (C, compiled by BCC at run time): shipped as the package kpr.bpf
(pyproject.toml maps it here), found by kpr/datapath/abi.py (BPF_DIR)."""
