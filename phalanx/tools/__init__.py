"""The bundled jobs: `phalanx bench` and `phalanx demo`. The library never imports this package."""
