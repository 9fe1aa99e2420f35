# Writes tests/data/checkpoints_a901c07.pt when run with muonfx at commit a901c07 on PYTHONPATH:
#   git worktree add /tmp/old a901c07 && PYTHONPATH=/tmp/old python tests/data/make_checkpoints.py tests/data/checkpoints_a901c07.pt
import sys, torch
import muonfx as mfx
print(mfx.__file__)
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
out = {}
def run(name, make):
    m = model(); opt = make(m)
    for i in range(3):
        torch.manual_seed(10 + i)
        m.zero_grad(); m(torch.randn(5, 8)).pow(2).sum().backward(); opt.step()
    out[name] = {"optim": opt.state_dict(), "model": m.state_dict()}
run("muon_adamw", lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.muon_adamw, lr=0.02, ns_dtype=torch.float32))
run("adamw", lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.adamw, lr=1e-2))
run("prebuilt_chain", lambda m: mfx.TransformOptimizer(m.named_parameters(), mfx.chain(mfx.momentum(0.9), mfx.apply_if_finite(mfx.scale_by_adam()), mfx.scale(-0.01))))
run("hybrid", lambda m: mfx.create_hybrid_optimizer(m, ns_dtype=torch.float32))
torch.save(out, sys.argv[1])
for k, v in out.items(): print(k, sorted(v["optim"]["state"][0]))
