"""Independent references the tests compare the plugin against (float64 math, transformers, fla)."""
