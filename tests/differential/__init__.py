"""The differential fuzzer: random combinations of the package's options and the Lightning tools
users run beside them, each checked against a float64 reference loop that shares no code with the
package (``reference.py``); under ``precision="bf16-true"`` the reference's windows run in bf16 and are compared bit
for bit (``bf16_reference.py``). ``python -m tests.differential --help`` for the long run."""
