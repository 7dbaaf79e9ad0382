"""qwen-serve stage services (imported as qwenserve_services)."""
