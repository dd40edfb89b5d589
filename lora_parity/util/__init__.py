"""util: shared helpers (errors, env, threads, lean, scratch, safe_read, safe_write, escape, interrupt).
Imports nothing from lora_parity outside util/; only the standard library.
The bottom floor: every other folder may import it.
"""
