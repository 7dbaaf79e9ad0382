"""The QwenDeployment operator (imported as qwenserve_operator)."""
