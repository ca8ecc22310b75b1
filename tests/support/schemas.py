"""The Kubernetes version whose OpenAPI schemas the manifests are validated against."""

from __future__ import annotations

K8S_VERSION = "1.34.0"  # the newest schemas kubernetes-validate (pinned in pyproject) ships
