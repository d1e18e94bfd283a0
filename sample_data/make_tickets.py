"""Writes sample_data/tickets.jsonl (the decisions example's input) and three OpenAI Batch files
of the same tickets, one endpoint each (a batch names one endpoint): systemone_batch.jsonl
(/v1/systemone), decisions_batch.jsonl (/v1/decisions) and chat_batch.jsonl
(/v1/chat/completions, scored over the labels the batch gives). Their lines name the models a
client of those APIs would (jev-latest, gpt-6-luna, gpt-4o-mini): `batchscore serve
--served-model-name` answers them (docs/operations.md); `batchscore run` scores them on the job's model.

The tickets are short customer-support messages written for this example; run
`python sample_data/make_tickets.py` to write the files again.
"""

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

TICKETS = [
    ("Charged twice for order 4411", "I was billed two times for the same order. Please refund the second charge today."),
    ("Package never arrived", "Tracking says delivered on Monday but there is nothing at my door. Where is my parcel?"),
    ("Cannot log in", "I reset my password three times and still get 'invalid credentials'. Is my account locked?"),
    ("Wrong size", "The jacket I ordered is a size too small. How do I exchange it for a large?"),
    ("Great service", "Just wanted to say the support agent yesterday was wonderful. Thanks a lot!"),
    ("Refund still missing", "You promised a refund two weeks ago and I have still not received it. This is unacceptable."),
    ("Suspicious email", "I got an email asking for my card number that claims to be from you. Is it real?"),
    ("Damaged on arrival", "The mug arrived broken into pieces. The box was crushed. I want my money back."),
    ("Change delivery address", "Can I still change the delivery address for order 9020? I am moving this week."),
    ("Subscription cancelled by itself", "My premium plan was cancelled without my consent and I was charged anyway."),
    ("Two-factor code not arriving", "The SMS with my login code never comes, so I cannot get into my account at all."),
    ("Late again", "Third time this month my order is late. I am furious and will cancel everything."),
]

QUESTIONS = {
    "team": {"type": "choice", "instructions": "Which team should handle this ticket?",
             "criteria": {"billing": "payments, charges, refunds", "shipping": "delivery, parcels, addresses",
                          "security": "account access, passwords, fraud", "other": None}},
    "refund": {"type": "noul", "instructions": "Does the customer ask for money back?"},
    "mood": {"type": "score", "instructions": "How upset is the customer?",
             "criteria": ["calm", "annoyed", "angry", "furious"]},
}


def main() -> None:
    with open(HERE / "tickets.jsonl", "w") as f:
        for i, (subject, body) in enumerate(TICKETS):
            f.write(json.dumps({"ticket_id": f"T{i + 1:03d}", "subject": subject, "body": body}) + "\n")
    systemone, decisions, chat = [], [], []
    for i, (subject, body) in enumerate(TICKETS[:6]):
        systemone.append({"custom_id": f"so-{i}", "method": "POST", "url": "/v1/systemone",
                      "body": {"model": "jev-latest", "state": {"subject": subject, "body": body},
                               "instructions": "You route customer-support tickets.", "questions": QUESTIONS}})
    for i, (subject, body) in enumerate(TICKETS[6:]):
        decisions.append({"custom_id": f"oa-{i}", "method": "POST", "url": "/v1/decisions",
                      "body": {"model": "gpt-6-luna", "input": f"{subject}. {body}", "questions": [
                          {"type": "predicate", "name": "refund", "instructions": "Does the customer ask for money back?"},
                          {"type": "choice", "name": "team", "instructions": "Which team should handle this?",
                           "choices": [{"value": "billing"}, {"value": "shipping"}, {"value": "security"}]},
                          {"type": "score", "name": "mood", "instructions": "How upset is the customer?",
                           "levels": [{"label": "calm"}, {"label": "annoyed"}, {"label": "furious"}]}]}})
    for i, (subject, body) in enumerate(TICKETS):
        chat.append({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": "gpt-4o-mini", "max_tokens": 1, "messages": [
                         {"role": "system", "content": "You route customer-support tickets. Answer with one word: "
                                                       "billing, shipping, security or other."},
                         {"role": "user", "content": f"{subject}\n\n{body}\n\nWhich team should handle this ticket?"}]}})
    for name, lines in [("systemone_batch.jsonl", systemone), ("decisions_batch.jsonl", decisions),
                        ("chat_batch.jsonl", chat)]:
        with open(HERE / name, "w") as f:
            for line in lines:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
