"""Math shared by the codecs: bit packing, rotations, the fast Hadamard transform, Lloyd-Max
codebooks, and the argument checks every public entry point uses."""
