# The chat requests `frugal train-heads --prompts docs/speculative/heads-prompts.txt` answers:
# everyday request templates (stories, explanations, tips, guides, comparisons...) crossed with
# topics and activities, seeded, deduplicated, and never naming what `bench speculate`'s own
# prompts are about (a lighthouse keeper, the blue sky, the guitar). Run from this folder.
import random
topics = """volcanoes|the moon|honey bees|the Roman Empire|photosynthesis|black holes|the water cycle|coral reefs|the printing press|electric cars|rainforests|the human heart|earthquakes|penguins|the internet|ancient Egypt|dinosaurs|the solar system|vaccines|recycling|the Olympic Games|chocolate|coffee|tea|the Great Wall of China|airplanes|trains|bicycles|the ocean tides|snowflakes|rainbows|thunderstorms|whales|elephants|owls|octopuses|ants|sharks|wolves|butterflies|the brain|sleep|dreams|memory|friendship|kindness|music|jazz|painting|photography|poetry|libraries|museums|bridges|skyscrapers|castles|pyramids|windmills|solar panels|batteries|magnets|gravity|electricity|light|sound|time zones|calendars|maps|compasses|money|banks|taxes|markets|farming|bread|cheese|pizza|rice|apples|bananas|potatoes|gardens|forests|deserts|mountains|rivers|lakes|islands|glaciers|caves|robots|computers|smartphones|video games|chess|football|basketball|swimming|yoga|birthdays|weddings|holidays|winter|summer|autumn|spring|the stars|comets|Mars|Jupiter|satellites|rockets|submarines|ships|pirates|knights|samurai|the Vikings|the Renaissance|the Industrial Revolution|democracy|newspapers|radio|television|movies|theater|dance|languages|alphabets|numbers|fractions|triangles|clocks|umbrellas|shoes|hats|cats|dogs|horses|rabbits|parrots|goldfish|frogs|spiders|bats|camels|kangaroos|pandas|tigers|polar bears|dolphins|jellyfish|mushrooms|trees|flowers|cactuses|seeds|soil|clouds|wind|fire|ice|salt|sugar|vitamins|exercise|breakfast|soup|sandwiches|cookies|ice cream|honey|bees and flowers|the alphabet|handwriting|email|passwords|online privacy|artificial intelligence|climate change|air pollution|plastic waste|clean water|public transport|city parks|small towns|neighbors|grandparents|teachers|doctors|firefighters|astronauts|inventors|scientists|explorers|farmers|chefs|artists""".split("|")
activities = """learning a new language|saving money|cooking pasta|baking bread|growing tomatoes|keeping a journal|running a marathon|studying for exams|waking up early|making friends in a new city|writing a resume|preparing for a job interview|taking better photos|reading more books|drawing portraits|learning to swim|training a puppy|caring for houseplants|cleaning the kitchen|organizing a closet|planning a trip|packing a suitcase|camping in the woods|riding a bicycle in the city|learning to code|staying focused at work|managing stress|sleeping better|eating healthy on a budget|starting a small business|giving a speech|writing a poem|learning to juggle|painting with watercolors|knitting a scarf|fixing a flat tire|building a bookshelf|hosting a dinner party|making coffee at home|brewing tea|teaching a child to read|learning chess|playing the piano|singing in a choir|learning to dance|doing yoga at home|hiking in the mountains|bird watching|fishing at a lake|volunteering in your community|recycling at home|reducing food waste|saving energy at home|working from home|taking notes in class|memorizing vocabulary|writing a short story|making a budget|buying a used car|choosing a laptop|protecting your privacy online|creating strong passwords|learning to meditate|making new habits stick|moving to a new house|raising chickens|keeping bees|starting a garden|making pizza dough|baking cookies|decorating a small room|writing thank-you notes|planning a birthday party|learning to ski|ice skating|staying warm in winter|staying cool in summer|drinking more water|walking every day|taking care of your teeth|learning to type faster|editing your own writing|speaking with confidence|listening well|resolving an argument|asking for a raise|teaching a class|leading a team|learning history|understanding the news""".split("|")
t_topic = [
 "Write a short story about {}.", "Write a short poem about {}.", "Explain {} in simple words.",
 "Tell me three interesting facts about {}.", "Describe {} to someone who has never seen them.",
 "What is the history of {}?", "Why are {} important?", "Explain {} to a child.",
 "Write a paragraph about {} for a school report.", "What are the pros and cons of {}?",
 "Give me a fun quiz with three questions about {}.", "Write a short dialogue between two friends about {}.",
 "How do {} work?", "What would the world be like without {}?", "Write a news report about {}.",
 "Compare {} and {}.", "Write a diary entry from someone who loves {}.", "What do scientists know about {}?",
 "Write a children's story about {}.", "Summarize what most people should know about {}.",
 "Write a song about {}.", "Write a letter to a friend about {}.", "What are common myths about {}?",
 "Describe a day in the life of someone who studies {}.", "Write a short essay about {}.",
]
t_act = [
 "Give me five tips for {}.", "How do I get started with {}?", "What are common mistakes when {}?",
 "Write a step-by-step guide to {}.", "Why is {} worth the effort?", "Give me a weekly plan for {}.",
 "What do I need for {}?", "Explain the basics of {} to a beginner.", "Write a motivational message about {}.",
 "What are the benefits of {}?", "Tell me a short story about someone {}.", "How long does it take to get good at {}?",
 "Give me three ideas for {}.", "Write a checklist for {}.", "What advice would you give a friend who is {}?",
]
import sys
# `--more`: the first 7,000 distinct requests of the same seeded draw, less the 3,400 of
# heads-prompts.txt (more-prompts.txt: a second store's worth of different requests).
more = "--more" in sys.argv
rng = random.Random(20261204)
out = set()
while len(out) < (7000 if more else 3400):
    if rng.random() < 0.6:
        t = rng.choice(t_topic)
        if t.count("{}") == 2:
            a, b = rng.sample(topics, 2); p = t.format(a, b)
        else:
            p = t.format(rng.choice(topics))
    else:
        p = rng.choice(t_act).format(rng.choice(activities))
    p = p[0].upper() + p[1:]
    out.add(p)
out = sorted(out)
rng.shuffle(out)
bench = ["lighthouse", "sky is blue", "guitar"]
out = [p for p in out if not any(b in p for b in bench)]
if more:
    first = set(open("heads-prompts.txt").read().split("\n"))
    out = [p for p in out if p not in first]
open("more-prompts.txt" if more else "heads-prompts.txt", "w").write("\n".join(out) + "\n")
print(len(out))
