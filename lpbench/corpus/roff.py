"""Manual pages to text: the man and mdoc macros, escapes and tables of roff stripped away.

Hand-written because no library on a bare machine reads roff into prose (``man``/``groff`` may be
absent, and their output is laid out for a terminal); used by :mod:`lpbench.corpus.build`.
"""

from __future__ import annotations

import re
import textwrap


def _pairs(text: str) -> dict[str, str]:
    """``"a b c d"`` as ``{"a": "b", "c": "d"}``."""
    words = text.split()
    return dict(zip(words[::2], words[1::2]))


_ROFF_CHARS = _pairs(  # special characters \(xx and \[xx] as text
    r"""
    em — en – hy - bu • aq ' dq " lq “ rq ” oq ‘ cq ’ co © rg ® tm ™ mu × di ÷ >= ≥ <= ≤ != ≠ -> → <- ←
    pl + mi - eq = ti ~ ha ^ rs \ sl / ga ` aa ´ de ° +- ± *W - *p pi ba |
    """
)
_ROFF_STRINGS = _pairs(
    """-- — - — L" " R" " C` " C' " Aq ' PI pi C+ C++ Tm (TM) lq “ rq ” R ®"""
)  # strings \*x and \*(xx
_ESCAPE = re.compile(
    r"""\\(?:
    f(?:\[[^\]]*\]|\(..|.)            # font
  | s[+-]?(?:\(\d\d|\[\d+\]|'\d+'|\d) # size
  | [nmgFY](?:\[[^\]]*\]|\(..|.)      # register, colour, font family
  | \*(?:\[([^\]]*)\]|\((..)|(.))     # string
  | \((..)                            # special character \(xx
  | \[([^\]]*)\]                      # special character \[name]
  | [hvwoxlLbDXNkzZSRH]'[^']*'        # motions, widths, drawing, \X'...'
  | [kz].                             # mark, zero-width
  | ([-e\\ 0~`'.&|^%c:!{}?acdprtu])   # one-character escapes
)""",
    re.X,
)
_ONE_CHAR = {"-": "-", "e": "\\", "\\": "\\", " ": " ", "0": " ", "~": " ", "`": "`", "'": "'", ".": "."}
_ALTERNATING = {"BR", "RB", "BI", "IB", "IR", "RI", "SB"}
_FONT_MACROS = {"B", "I", "SM", "R", "CW"}
_BREAKS = set("PP LP P sp br HP RS RE in ti Sp Pp Lp Bl El Bd Ed ne bp TQ PD".split())
_MDOC_CALLABLE = set(
    """
    Ac Ad An Ao Ap Aq Ar At Bc Bo Bq Brc Bro Brq Bsx Bx Cd Cm Dc Do Dq Dv Dx Ec Em En Eo Er Es Ev Fa Fc Fl Fn Fo Fr
    Ft Fx Ic Li Lk Ms Mt Nm No Ns Nx Oc Oo Op Ot Ox Pa Pc Pf Po Pq Qc Ql Qo Qq Sc So Sq Sx Sy Ta Tn Ux Va Vt Xc Xo Xr
    """.split()
)
_BLOCK_END = {"de": "..", "ig": "..", "am": "..", "TS": "TE", "EQ": "EN", "PS": "PE"}


def _escape(m: re.Match) -> str:
    string = m.group(1) or m.group(2) or m.group(3)
    if string is not None:
        return _ROFF_STRINGS.get(string, "")
    special = m.group(4) or m.group(5)
    if special is not None:
        return _ROFF_CHARS.get(special, "")
    one = m.group(6)
    if one is not None:
        return _ONE_CHAR.get(one, "")
    return ""


def roff_inline(text: str) -> str:
    """``text`` with roff escapes resolved to characters (fonts, sizes and motions dropped)."""
    text = text.replace("\\\\", "\x00")
    text = _ESCAPE.sub(_escape, text)
    return text.replace("\x00", "\\")


def _args(rest: str) -> list[str]:
    """Macro arguments: blank-separated, double quotes group (``""`` is a literal quote)."""
    out, cur, quoted, i = [], "", False, 0
    while i < len(rest):
        c = rest[i]
        if c == '"':
            if quoted and rest[i + 1 : i + 2] == '"':
                cur += '"'
                i += 1
            else:
                quoted = not quoted
        elif c in " \t" and not quoted:
            if cur:
                out.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    if cur:
        out.append(cur)
    return out


def _mdoc(name: str, args: list[str], state: dict) -> str:
    """Text of an mdoc line: callable macros dropped or rendered (``Fl x`` -> ``-x``)."""
    words: list[str] = []
    glue = False
    i = 0
    tokens = [name] + args
    while i < len(tokens):
        t = tokens[i]
        if t in _MDOC_CALLABLE or t in ("It", "Nd", "Sh", "Ss", "D1", "Dl"):
            if t == "Fl":
                nxt = tokens[i + 1] if i + 1 < len(tokens) and tokens[i + 1] not in _MDOC_CALLABLE else ""
                words.append("-" + nxt)
                i += 2 if nxt else 1
                continue
            if t == "Xr" and i + 2 < len(tokens):
                words.append(f"{tokens[i + 1]}({tokens[i + 2]})")
                i += 3
                continue
            if t == "Nm":
                if i + 1 < len(tokens) and tokens[i + 1] not in _MDOC_CALLABLE:
                    state.setdefault("mdoc_name", tokens[i + 1])
                else:
                    words.append(state.get("mdoc_name", ""))
            elif t == "Nd":
                words.append("\u2014")
            elif t in ("Ux", "Bx", "Ox", "Nx", "Fx", "Bsx", "Dx", "At"):
                words.append({"Ux": "UNIX", "At": "AT&T UNIX"}.get(t, t.upper() if len(t) == 2 else "BSD/OS"))
            elif t in ("Ns", "Pf", "Ap"):
                glue = True
            i += 1
            continue
        if glue and words:
            words[-1] += t
            glue = False
        elif words and re.fullmatch(r"[.,:;)\]?!]+", t):
            words[-1] += t
        else:
            words.append(t)
        i += 1
    return " ".join(w for w in words if w)


def strip_roff(source: str) -> str:
    """Plain text of a man page (man or mdoc macros): headings and paragraphs, blank-line separated.

    Filled text is joined into one line per paragraph; no-fill blocks (examples) keep their lines.
    Conditionals take their nroff branch; macro definitions, register/string set-up, tables and
    equations are dropped.
    """
    paras: list[str] = []
    cur: list[str] = []
    st = {"fill": True, "end_block": None, "tag": False, "else": False}

    def flush():
        text = "\n".join(cur).strip("\n")
        text = re.sub(r"[ \t]+", " ", text.replace("\n", " ")).strip() if st["fill"] else textwrap.dedent(text)
        if text.strip():
            paras.append(text)
        cur.clear()

    def request(name: str, rest: str) -> None:
        if name in ("if", "ie", "el"):
            cond, _, body = (("n" if st["else"] else "f") + " " + rest if name == "el" else rest).partition(" ")
            if name == "ie":
                st["else"] = cond == "t"  # the .el branch runs where nroff's did not
            body = body.strip().removeprefix("\\{").removesuffix("\\").strip()
            if cond == "n" and body:
                line(body)
            return
        if name in _BLOCK_END:
            st["end_block"] = _BLOCK_END[name]
            return
        args = [roff_inline(a) for a in _args(rest)]
        if name in ("SH", "SS", "Sh", "Ss"):
            flush()
            paras.append(" ".join(args))
        elif name in ("nf", "EX", "Vb", "Bd") and not (name == "Bd" and "-filled" in rest):
            flush()
            st["fill"] = False
        elif name in ("fi", "EE", "Ve", "Ed"):
            flush()
            st["fill"] = True
        elif name in ("TP", "IP", "It"):
            flush()
            tag = args[0] if name == "IP" and args else _mdoc("It", args, state) if name == "It" else ""
            st["tag"] = name == "TP"
            if tag:
                cur.append(tag)
                flush()
        elif name in _BREAKS:
            flush()
        elif name in _FONT_MACROS:
            cur.append(" ".join(args))
        elif name in _ALTERNATING:
            cur.append("".join(args))
        elif name in ("UR", "MT"):
            state["url"] = args[0] if args else ""
        elif name in ("UE", "ME"):
            cur.append(f"<{state.pop('url', '')}>" + "".join(args))
        elif name in _MDOC_CALLABLE or name in ("Nd", "D1", "Dl"):
            cur.append(_mdoc(name, args, state))
        # other requests (.TH .ds .nr .ft .ad .so .IX ...) carry no text
        if st["tag"] and cur:  # the line after .TP is the tag, text or macro
            flush()
            st["tag"] = False

    def line(raw: str) -> None:
        if raw.startswith((".", "'")):
            m = re.match(r"(\S+)\s*(.*)", re.sub(r'\\".*', "", raw[1:].lstrip()))
            if m:
                request(m.group(1), m.group(2))
            return
        text = roff_inline(raw)
        if st["fill"] and not text.strip():
            flush()
            return
        cur.append(text.rstrip())
        if st["tag"]:
            flush()
            st["tag"] = False

    state: dict = {}
    for raw in source.splitlines():
        if st["end_block"] is not None:
            end, stripped = st["end_block"], raw.strip()
            if stripped.startswith("..") if end == ".." else re.match(rf"[.']\s*{end}\b", stripped):
                st["end_block"] = None
        elif not raw.startswith(('.\\"', "'\\\"", '\\"')):
            line(raw)
    flush()
    return "\n\n".join(paras)
