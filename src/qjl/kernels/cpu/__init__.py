"""The CPU kernels: C sources compiled once per machine with cffi (:mod:`qjl.kernels.cpu.build`) and
their launchers (:mod:`qjl.kernels.cpu.launch`)."""
