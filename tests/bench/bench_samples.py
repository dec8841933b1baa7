"""fairseq log lines shared by the tests of tests/bench (imported as a helper module)."""

# Lines as fairseq 0.12.3 writes them with --user-dir fairseq_vasso --optimizer vasso
CONFIG = ("2026-11-22 05:04:53 | INFO | fairseq_cli.train | {'_name': None, 'optimizer': {'_name': 'vasso', "
          "'adam_betas': '(0.9, 0.98)', 'adam_eps': 1e-08, 'weight_decay': 0.0, 'rho': 0.1, 'adaptive': False, "
          "'adaptive_eta': 0.01, 'gsam_alpha': 0.0, 'perturb_prob': 0.5, 'seed': 3, 'lr': [0.002], 'theta': 0.4}, "
          "'lr_scheduler': {'_name': 'inverse_sqrt', 'warmup_updates': 4}}")
SIMPLE_INNER = [
    "2026-11-22 05:04:59 | INFO | train_inner | epoch 001:      2 / 15 loss=10.15, nll_loss=10.146, ppl=1133.28, "
    "wps=2328.4, ups=7, wpb=306, bsz=36, num_updates=2, lr=0.001, gnorm=1.455, train_wall=0, ascent_norm=0.1, "
    "loss_gap=0.19491, sharpness=0.12583, stability=0.04301, two_pass=1, rho=0.1, wall=5",
    "2026-11-22 05:04:59 | INFO | train_inner | epoch 001:      4 / 15 loss=10.139, nll_loss=10.134, ppl=1123.95, "
    "wps=4266.2, ups=15.35, wpb=278, bsz=28, num_updates=4, lr=0.002, gnorm=1.39, train_wall=0, ascent_norm=0.1, "
    "loss_gap=0.18352, sharpness=0.12204, stability=0.0286, two_pass=1, rho=0.1, wall=5",
    # an interval whose updates all skipped the second pass (eVASSO): fairseq prints nan
    "2026-11-22 05:04:59 | INFO | train_inner | epoch 001:      6 / 15 loss=9.811, ups=14.5, num_updates=6, "
    "ascent_norm=nan, loss_gap=nan, sharpness=nan, stability=nan, two_pass=0, rho=0.1, wall=5",
]
SIMPLE_EPOCH = ("2026-11-22 05:04:59 | INFO | train | epoch 001 | loss 9.671 | nll_loss 9.618 | ups 12.01 | "
                "num_updates 12 | stability 0.0293 | two_pass 1 | wall 6")
SIMPLE_VALID = ("2026-11-22 05:04:59 | INFO | valid | epoch 001 | valid on 'valid' subset | loss 9.053 | "
                "num_updates 12")
JSON_INNER = ('2026-11-22 05:05:18 | INFO | train_inner | {"epoch": 1, "update": 0.133, "loss": "10.15", '
              '"ups": "8.05", "num_updates": "2", "ascent_norm": "0.1", "loss_gap": "0.19491", '
              '"sharpness": "0.12583", "stability": "0.04301", "two_pass": "1", "rho": "0.1", "wall": "2"}')
JSON_EPOCH = ('2026-11-22 05:05:18 | INFO | train | {"epoch": 1, "train_loss": "9.671", "train_ups": "10.9", '
              '"train_num_updates": "12", "train_train_wall": "1", "train_stability": "0.0293", "train_wall": "3"}')

