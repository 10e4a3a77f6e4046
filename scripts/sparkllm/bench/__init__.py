"""The benchmark: `scripts/bench.py` is a thin entry over these modules; everything `bench.py run` imports
is standard library (it runs on the Spark), only `report` needs matplotlib (imported lazily)."""
