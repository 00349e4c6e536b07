"""Planned device memory per call of each workload and phase beside PyTorch's measured
peak, from the device-free compile stage: see meganeura.bench.memory
(python bench/memory.py --help)."""
from meganeura.bench.memory import main

if __name__ == "__main__":
    main()
