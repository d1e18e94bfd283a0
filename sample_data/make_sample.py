"""Regenerate sample_data/relevance.parquet: 20 product pages × 10 shopper queries.

Run: python sample_data/make_sample.py  (deterministic; the Parquet file is committed)
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

PRODUCTS = [
    ("P001", "Trailblazer 2 Waterproof Hiking Boots", "Men's mid-cut hiking boots with a waterproof breathable membrane, Vibram outsole for grip on wet rock, padded collar and a cushioned EVA midsole. Leather and mesh upper. Weight 620 g per boot. Available in sizes 7 to 13, colors brown and slate grey."),
    ("P002", "AeroPress Go Portable Coffee Maker", "Compact coffee press for travel: brews espresso-style coffee in about one minute. Includes a mug that doubles as the storage case, 350 micro-filters, a scoop and a stirrer. BPA-free polypropylene, dishwasher safe. Makes 1 to 3 cups per press."),
    ("P003", "Kids' Balance Bike 12 inch", "Lightweight aluminum balance bike for children aged 2 to 5. No pedals: teaches steering and balance before riding a pedal bike. Adjustable seat and handlebar height, puncture-proof foam tires, weighs 3 kg. Colors red, blue and mint."),
    ("P004", "Noise-Cancelling Over-Ear Headphones NC700", "Wireless Bluetooth 5.3 headphones with adaptive active noise cancelling, 30-hour battery life, fast charging (10 minutes for 5 hours of play), multipoint pairing with two devices and a foldable design with a hard travel case. Built-in microphones for calls."),
    ("P005", "Cast Iron Skillet 10.25 inch, Pre-Seasoned", "Pre-seasoned cast iron frying pan that holds heat evenly, for searing, baking and frying. Works on gas, electric, induction, in the oven and over a campfire. Hand wash and dry, then oil lightly. Made in the USA."),
    ("P006", "Organic Cotton Crib Sheets, 2-Pack", "Fitted crib sheets in GOTS-certified organic cotton jersey, soft and breathable. Fits standard crib mattresses 28 x 52 inches with elastic all around. Machine washable, gets softer with every wash. Patterns: stars and clouds."),
    ("P007", "Smart Wi-Fi Thermostat T9", "Programmable smart thermostat with room sensors, learns your schedule, works with voice assistants and a phone app, shows energy reports. Requires a C-wire for most systems; adapter included. Compatible with most 24 V heating and cooling systems."),
    ("P008", "Yoga Mat 6 mm Non-Slip", "Extra-thick exercise mat of TPE foam, 183 x 61 cm, with a non-slip textured surface on both sides and alignment lines. Free of latex and PVC. Comes with a carrying strap. Suitable for yoga, pilates and floor workouts."),
    ("P009", "Stainless Steel Insulated Water Bottle 1 L", "Double-wall vacuum insulated bottle that keeps drinks cold for 24 hours and hot for 12. Leak-proof lid with a carry loop, wide mouth fits ice cubes, powder-coated finish that does not sweat. BPA-free, not dishwasher safe."),
    ("P010", "Cordless Drill Driver 20V with 2 Batteries", "Compact 20 V lithium-ion drill with a 2-speed gearbox, 1/2-inch keyless chuck, 24 clutch settings and an LED work light. Kit includes two 2.0 Ah batteries, a fast charger and a carrying bag. Drills wood, metal and plastic."),
    ("P011", "Hardcover Novel: The Lighthouse Keeper's Daughter", "A historical novel set on the Maine coast in 1889: after a shipwreck, a lighthouse keeper's daughter hides a survivor and uncovers a smuggling ring. 432 pages, hardcover, first edition. Book club discussion questions at the back."),
    ("P012", "Dog Harness No-Pull, Medium", "Padded no-pull harness for medium dogs with a front clip that discourages pulling and a back clip for everyday walks. Reflective stitching, four adjustment points, quick-release buckles. Chest girth 56 to 76 cm."),
    ("P013", "Electric Toothbrush Sonic Pro", "Rechargeable sonic toothbrush with 5 cleaning modes, a 2-minute timer with 30-second pacer, pressure sensor and a travel case. One charge lasts 30 days. Includes 3 brush heads. Waterproof IPX7."),
    ("P014", "Women's Merino Wool Base Layer Top", "Long-sleeve base layer in 100% merino wool, 200 g/m², naturally odor resistant and temperature regulating for skiing, hiking and cold-weather running. Flatlock seams avoid chafing. Machine wash cold. Sizes XS to XL."),
    ("P015", "4-Person Dome Camping Tent", "Freestanding dome tent for four with two doors, two vestibules for gear, color-coded poles for a 10-minute setup, a full rainfly rated to 3000 mm and mesh panels for airflow. Packed weight 4.8 kg. Floor 240 x 210 cm."),
    ("P016", "Air Fryer 5.8 Quart with Digital Display", "Hot-air fryer that cooks with little or no oil: 8 presets for fries, chicken, fish and baking, temperatures from 80 to 200 °C, a 60-minute timer and a nonstick dishwasher-safe basket. 1700 W. Fits a whole 2 kg chicken."),
    ("P017", "Mechanical Keyboard 75% Hot-Swappable", "Compact 75% layout mechanical keyboard with hot-swappable switches (pre-installed tactile browns), per-key RGB backlight, aluminum top case, USB-C wired and Bluetooth wireless modes, and Mac and Windows keycaps."),
    ("P018", "Vitamin D3 2000 IU Softgels, 180 Count", "Daily vitamin D3 (cholecalciferol) supplement in olive oil softgels to support bones, teeth and the immune system. 180 softgels, a six-month supply. Gluten free, non-GMO. Take one softgel daily with a meal."),
    ("P019", "Robot Vacuum with Self-Empty Base", "Wi-Fi robot vacuum with lidar navigation and room mapping, 4000 Pa suction, no-go zones in the app and a self-empty base that holds up to 60 days of dirt. Works on carpets and hard floors. 150 minutes of runtime per charge."),
    ("P020", "Watercolor Paint Set, 48 Colors", "Artist watercolor set with 48 half pans of richly pigmented paint in a metal tin with a mixing palette, two water brushes and a pad of 300 g/m² cold-press paper. For beginners and professionals."),
]

QUERIES = [
    "waterproof boots for hiking in the rain",
    "gift for a coffee lover who travels",
    "first bike for a toddler",
    "headphones for long flights",
    "pan I can use on an induction stove",
    "soft sheets for a baby crib",
    "save energy on heating at home",
    "thick mat for home workouts",
    "bottle that keeps water cold all day",
    "tool to hang shelves on a brick wall",
]


def main() -> None:
    rows = []
    for pid, title, description in PRODUCTS:
        for qi, query in enumerate(QUERIES):
            rows.append({"pair_id": f"{pid}-Q{qi:02d}", "product_id": pid, "title": title,
                         "description": description, "query": query})
    out = Path(__file__).with_name("relevance.parquet")
    pq.write_table(pa.Table.from_pylist(rows), out)
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
