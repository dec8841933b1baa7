"""The translation tools around the plugin: BLEU scoring, the self-test's fairseq runs,
the toy corpus and the paper's rows.

They drive fairseq through its console scripts (subprocesses), so importing them
imports neither fairseq nor the plugin's hooks; the plugin itself is the package
root (:mod:`fairseq_vasso`, :mod:`fairseq_vasso.optimizer`, :mod:`fairseq_vasso.hooks`).
The recipes that use them (IWSLT-14 preparation and training, the demo, the benchmark)
sit in ``scripts/``.

=====================  ========================================================
module                 what
=====================  ========================================================
``recipe``             the paper's NMT rows, fairseq's console scripts, logged runs
``toy_corpus``         the self-test's and the demo's German-English corpus
``bleu``               ``vasso-bleu``: fairseq-generate per checkpoint, BLEU tables
``logs``               fairseq's training-log lines as records (``vasso-plot``)
``selftest``           ``vasso-selftest``'s fairseq-train runs in every precision mode
=====================  ========================================================
"""
