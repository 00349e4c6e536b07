"""Compile seconds per workload graph, device-free (stages, plan cache) or on the device
(cold / warm process / again): see meganeura.bench.compile_time (python bench/compile_time.py --help)."""
from meganeura.bench.compile_time import main

if __name__ == "__main__":
    main()
