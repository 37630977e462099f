"""Two more texts for the 8-bit-bounds perplexity check, independent of scripts/ppl.py's default text.

    python benchmarks/accuracy/bounds8_texts.py OUT_DIR

Writes OUT_DIR/langref.txt (the Python language reference and library topics that `pydoc_data.topics` ships: prose
with code) and OUT_DIR/docstrings2.txt (the docstrings of stdlib modules that the default text does not use), both
deterministic per Python version and read by `scripts/ppl.py --text-file`.
"""
import os
import sys

from quest_hf.eval.ppl import STDLIB_MODULES, stdlib_text

OTHER_MODULES = ["abc", "ast", "base64", "bdb", "cmd", "code", "codeop", "configparser", "contextvars", "dis",
                 "filecmp", "fileinput", "fnmatch", "ftplib", "getopt", "gettext", "glob", "graphlib", "gzip",
                 "hashlib", "hmac", "imaplib", "ipaddress", "linecache", "lzma", "mailbox", "mimetypes",
                 "modulefinder", "netrc", "numbers", "optparse", "pickletools", "pkgutil", "platform", "plistlib",
                 "poplib", "profile", "pstats", "py_compile", "pyclbr", "pydoc", "reprlib", "runpy", "secrets",
                 "shelve", "shlex", "smtplib", "socketserver", "sqlite3", "ssl", "symtable", "sysconfig",
                 "tabnanny", "tokenize", "tomllib", "trace", "traceback", "tracemalloc", "types", "uuid", "venv",
                 "warnings", "wave", "webbrowser", "wsgiref.simple_server", "xml.dom.minidom",
                 "xml.etree.ElementTree", "xmlrpc.client", "zipapp", "zipimport", "zoneinfo"]


def main(out_dir):
    assert not set(OTHER_MODULES) & set(STDLIB_MODULES)
    os.makedirs(out_dir, exist_ok=True)
    from pydoc_data.topics import topics
    langref = "\n\n".join(topics[k] for k in sorted(topics))
    docs, source = stdlib_text(OTHER_MODULES)
    for name, text in (("langref.txt", langref), ("docstrings2.txt", docs)):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)
        print(f"{name}: {len(text)} characters")
    print(source)


if __name__ == "__main__":
    main(sys.argv[1])
