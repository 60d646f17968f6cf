# Two optimizers and one GradScaler, the way AMP GAN scripts are written: the critic's gradients
# are larger, so near the scale's limit its step() alone is skipped (an overflow in its gradients
# only) while the generator's goes on: 24 iterations, the critic skipped in 8 (before and after the
# corpus's cut at step 8), the generator in none. Before session 25 the first iteration where both
# stepped (the 5th) made the script unresumable for good ("optimizers stepped in a varying order").
import sys

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(21)
real = torch.randn(96, 4) * 0.5 + 1.0
generator = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 4))
critic = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt_g = torch.optim.SGD(generator.parameters(), lr=0.01)
opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 127, growth_interval=5)
for epoch in range(2):
    for (batch,) in DataLoader(TensorDataset(real), batch_size=8, shuffle=True):
        noise = torch.randn(batch.shape[0], 3)
        opt_c.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            fake = generator(noise).float()
            loss_c = 30.0 * (critic(fake.detach()).float().mean() - critic(batch).float().mean())
        scaler.scale(loss_c).backward()
        scaler.step(opt_c)
        opt_g.zero_grad()
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
            loss_g = -critic(generator(noise).float()).float().mean()
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)
        scaler.update()
print(f"scale {scaler.get_scale()}")
torch.save({"generator": generator.state_dict(), "critic": critic.state_dict(),
            "optimizers": [opt_g.state_dict(), opt_c.state_dict()], "scaler": scaler.state_dict()},
           sys.argv[1] if len(sys.argv) > 1 else "final.pt")
