"""A small built-in calibration set: varied English paragraphs (prose, dialogue, code, lists, instructions)."""

TEXTS = (
    "The city library opens at nine in the morning. On weekdays the reading room fills quickly with students, "
    "retirees reading newspapers, and a few people who come only for the quiet and the free wireless network.",
    "To boil an egg, place it in a saucepan, cover it with cold water and bring the water to a boil. Turn the heat "
    "down, wait nine minutes for a firm yolk, then cool the egg in cold water before peeling it.",
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n"
    "print([fibonacci(i) for i in range(10)])\n",
    "Photosynthesis converts light energy into chemical energy. Plants take in carbon dioxide and water, and with "
    "the help of chlorophyll they produce glucose and release oxygen as a by-product.",
    "User: What is the capital of Australia?\nAssistant: The capital of Australia is Canberra. Many people guess "
    "Sydney or Melbourne, but Canberra was chosen as a compromise between the two cities.",
    "The meeting is moved to Thursday at 3 pm. Please bring the quarterly figures, the draft budget for next year "
    "and any questions about the new travel policy. Coffee will be provided.",
    "In 1969, two astronauts walked on the Moon while a third orbited above. The mission lasted eight days and "
    "returned 21 kilograms of lunar samples to Earth for scientific study.",
    "A good night's sleep helps memory, mood and the immune system. Experts suggest a regular schedule, a dark "
    "and cool bedroom, and avoiding screens for an hour before going to bed.",
    "SELECT name, COUNT(*) AS orders\nFROM customers JOIN orders ON customers.id = orders.customer_id\n"
    "GROUP BY name\nORDER BY orders DESC\nLIMIT 10;",
    "Once upon a time, a small fox lived at the edge of a great forest. Every evening she climbed the hill behind "
    "her den to watch the lights of the village and wonder what the people there were talking about.",
    "Shopping list: two litres of milk, a loaf of bread, six eggs, tomatoes, an onion, rice, olive oil, and "
    "something for dessert, maybe apples or a small chocolate cake.",
    "The derivative of x squared is two x. More generally, the derivative of x to the power n is n times x to the "
    "power n minus one, a rule that follows from the binomial theorem.",
    "Dear Ms. Patel, thank you for your letter of 12 March. I am pleased to confirm that your application has been "
    "accepted, and I look forward to meeting you at the start of the programme.",
    "Water boils at 100 degrees Celsius at sea level, but at lower temperatures on high mountains, where the air "
    "pressure is lower. That is why pasta takes longer to cook in the Alps.",
    "for (int i = 0; i < n; ++i) {\n    sum += values[i] * weights[i];\n}\nreturn sum / n;",
    "The train was late again. Maria checked her watch, sighed, and opened her book. By the time the train "
    "arrived she had finished two chapters and forgotten why she had been in a hurry.",
    "Machine learning models learn patterns from data. A language model, for example, is trained to predict the "
    "next word in a sentence, and from that simple task it learns grammar, facts and some reasoning.",
    "Step 1: unplug the router. Step 2: wait thirty seconds. Step 3: plug it back in and wait until the lights are "
    "steady. If the problem persists, contact your internet provider.",
    "The Great Wall of China is not a single wall but a series of walls built over many centuries by different "
    "dynasties to protect against invasions from the north.",
    "Q: Why is the sky blue?\nA: Sunlight is scattered by the molecules of the atmosphere, and blue light, which "
    "has a shorter wavelength, is scattered much more than red light.",
    "Our team shipped the new search feature last week. Early numbers look good: queries are faster, users click "
    "more results, and the number of support tickets about search has dropped.",
    "She planted tomatoes, beans and basil in the spring. By August the garden was so full that she gave baskets of "
    "vegetables to her neighbours every weekend.",
    "import numpy as np\n\nx = np.linspace(0, 1, 100)\ny = np.sin(2 * np.pi * x)\nprint(y.mean(), y.std())\n",
    "The human heart beats about one hundred thousand times a day, pumping blood through a network of vessels that "
    "would stretch more than twice around the Earth if laid end to end.",
    "Write a short poem about autumn.\nLeaves of amber drift and fall,\nthe wind goes whispering down the hall,\n"
    "and evening comes a little soon to light the lamp and greet the moon.",
    "Interest is charged monthly on the outstanding balance. If you pay the full amount by the due date, no "
    "interest is added, and your credit score may improve over time.",
    "The museum's new exhibition shows tools, jewellery and pottery from the Bronze Age, found during the "
    "construction of a motorway only a few kilometres from the town centre.",
    "Translate to French: Good morning, how are you today?\nBonjour, comment allez-vous aujourd'hui ?",
    "A balanced diet includes vegetables, fruit, whole grains, protein and healthy fats. Drinking enough water and "
    "limiting sugar and processed food are also important for long-term health.",
    "The committee reviewed twelve proposals and selected three for funding. Each project will receive support for "
    "two years, with a review of progress at the end of the first year.",
    "git checkout -b feature/login\ngit add src/login.py tests/test_login.py\ngit commit -m \"Add login form\"\n"
    "git push origin feature/login",
    "Rain fell all night on the tin roof of the cabin. In the morning the river had risen, and the path to the "
    "village was under water, so they stayed inside, played cards and waited.",
)
