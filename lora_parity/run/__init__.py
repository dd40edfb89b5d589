"""run: one run and the selftest: options, preflight, plan, runner, the phases, sync modes, faults,
probes, generation, routing, calibration on the trainer, start adapter, early launch.
May import util/, evidence/, verdict/, models/ and backends/; never cli/ or report/.
"""
