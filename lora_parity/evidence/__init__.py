"""evidence: the receipt as data (receipt_models, receipt_stats, receipt: digest and seal, receipt_io: bounded reading),
its signing, where it is written (outpath) and the tracebacks it records.
May import util/ only; verdict/, models/ and everything above read it, it reads none of them.
"""
