"""VmRSS / VmHWM / RssAnon / RssFile at labelled points of `monobatch generate` (the load's stages, the
engine, steps 1-3 and every 64th): .venv/bin/python rss_marks.py GENERATE-FLAGS... (diagnostics on stderr)."""
import sys, os, time
def st():
    d = {l.split(':')[0]: int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(('Vm', 'Rss'))}
    return d
N = [0]
def mark(name):
    d = st(); m = len(sys.modules)
    print(f"{name:28s} rss {d['VmRSS']/1024:6.1f} hwm {d['VmHWM']/1024:6.1f} anon {d['RssAnon']/1024:6.1f} file {d['RssFile']/1024:5.1f} mods {m}", file=sys.stderr)
def wrap(mod, attr, label):
    f = getattr(mod, attr)
    def w(*a, **k):
        mark('>' + label); r = f(*a, **k); mark('<' + label); return r
    setattr(mod, attr, w)
mark('start')
import torch; mark('torch')
import monobatch.cli.main
from monobatch.loader import gguf_file, weights as W
import monobatch.loader as L
from monobatch.tokenizer import Tokenizer
import monobatch.engine.engine as E, monobatch.engine.scheduler as S
mark('mb imports')
wrap(gguf_file, 'open_gguf', 'open_gguf')
wrap(gguf_file, 'load_gguf_model', 'load_gguf_model')
wrap(L, 'load_model', 'load_model')
tf = Tokenizer.from_gguf.__func__
Tokenizer.from_gguf = classmethod(lambda cls, r: (mark('>tok'), tf(cls, r), mark('<tok'))[1])
ei = E.Engine.__init__
def einit(self, *a, **k):
    mark('>Engine'); ei(self, *a, **k); mark('<Engine')
E.Engine.__init__ = einit
_step = E.Engine.step; n=[0]
def step(self, *a, **k):
    r = _step(self, *a, **k); n[0] += 1
    if n[0] <= 3 or n[0] % 64 == 0: mark(f'step{n[0]}')
    return r
E.Engine.step = step
import monobatch.cli.generate as G
rc = monobatch.cli.main.main(['generate'] + sys.argv[1:])
mark('end')
os._exit(rc)
