"""Each stage's configuration: its options dataclass, strict parser and start-up checks (`common.py` holds what
every stage shares). The library, the stages' servers (`qwenserve_services`) and the operator's manifests all read
them from here; nothing in this package imports torch or a gRPC server."""
