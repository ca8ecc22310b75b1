"""Health: the proxier's /healthz and /livez, and the Services' healthCheckNodePort servers."""
