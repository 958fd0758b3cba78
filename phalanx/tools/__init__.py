"""The bundled jobs: `phalanx bench` and `phalanx demo`. The library never imports this package.

May import: phalanx, engine, exchange, checkpoint, data, launch, testing, hooks, nn, shm, world, diagnose, allocator,
errors, log.
"""
