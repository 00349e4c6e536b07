"""Dispatches per call of each workload and phase, from the device-free compile stage:
see meganeura.bench.dispatches (python bench/dispatches.py --help)."""
from meganeura.bench.dispatches import main

if __name__ == "__main__":
    main()
