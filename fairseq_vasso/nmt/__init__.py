"""The translation tools around the plugin: BLEU scoring, IWSLT-14
preparation, the toy corpus, the recipe's rows and the fairseq-train benchmark.

They drive fairseq through its console scripts (subprocesses), so importing them
imports neither fairseq nor the plugin's hooks; the plugin itself is the package
root (:mod:`fairseq_vasso`, :mod:`fairseq_vasso.optimizer`, :mod:`fairseq_vasso.hooks`).

=====================  ========================================================
module                 what
=====================  ========================================================
``recipe``             the paper's NMT rows, fairseq's console scripts, logged runs
``toy_corpus``         the demo's deterministic German-English corpus
``iwslt14``            IWSLT-14 de-en as fairseq's ``prepare-iwslt14.sh``
``bleu``               ``vasso-bleu``: fairseq-generate per checkpoint, BLEU tables
``logs``               fairseq's training-log lines as records (``vasso-plot``)
``bench``              fairseq-train's cost per update (``scripts/benchmark.py``)
=====================  ========================================================
"""
