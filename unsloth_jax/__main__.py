"""`python -m unsloth_jax [--json]`: run the doctor (versions, devices, bf16, Pallas kernel checks)."""
import sys

from unsloth_jax.doctor import main

if __name__ == "__main__":
    sys.exit(main())
