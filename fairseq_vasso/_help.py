"""Make ``fairseq-train --user-dir fairseq_vasso --optimizer vasso --help`` list the flags.

fairseq prints ``--help`` in the first pass of ``options.parse_args_and_arch``,
before any optimizer has added its arguments (stock ``--optimizer adam --help`` does
not list ``--adam-betas`` either).  The user-dir is imported earlier, while
``options.get_parser`` is building the parser.  When, and only when, the command
line asks for help with ``--optimizer sam|vasso``, this wraps
``fairseq.options.parse_args_and_arch`` so that it first adds the optimizer's
dataclass fields as an argument group: the help then shows them.  In every other
case nothing is touched.
"""

import functools
import sys


def _requested_optimizer(args):
    name = None
    for i, a in enumerate(args):
        if a == "--optimizer" and i + 1 < len(args):
            name = args[i + 1]
        elif a.startswith("--optimizer="):
            name = a.split("=", 1)[1]
    return name


def add_flags_to_help(configs, argv=None):
    """``configs``: optimizer name -> dataclass."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not ({"-h", "--help"} & set(args)):
        return
    name = _requested_optimizer(args)
    if name not in configs:
        return
    from fairseq import options
    from fairseq.dataclass.utils import gen_parser_from_dataclass

    stock = options.parse_args_and_arch
    if getattr(stock, "_fairseq_vasso_help", False):
        return

    @functools.wraps(stock)
    def parse_args_and_arch(parser, *a, **k):
        try:
            group = parser.add_argument_group(f"optimizer '{name}' (fairseq_vasso)")
            gen_parser_from_dataclass(group, configs[name]())
        except Exception:  # help text is a convenience: never break argument parsing
            pass
        return stock(parser, *a, **k)

    parse_args_and_arch._fairseq_vasso_help = True
    options.parse_args_and_arch = parse_args_and_arch
