"""Training and the guardian: the trajectory buffer (buffer), seed demonstrations (demos, seeding),
LoRA fine-tuning (trainer), the guardian that sizes the work to the machine (guardian), its choice
for this client, kept across restarts (sizing), and the organisation's privacy budget (privacy)."""
