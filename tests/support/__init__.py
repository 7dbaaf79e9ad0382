"""What the tests share: checkpoints, ports, metrics scraping, local clusters, a Redis server, the session's
processes. Test modules and conftest files import from here, never from each other."""
