"""qwen-serve stage services (imported as qwenserve_services)."""

import qwenserve  # noqa: F401 - first, before any stage imports grpc: it settles the log format
